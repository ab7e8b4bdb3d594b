"""OpenAI / vLLM wire shapes: what a request body must look like, what the router strips from
it, the error body, and the answers and stream chunks the router builds itself (the LMCache
route, whose decode leg is a ``/v1/completions`` request). No I/O.

Shapes checked against vLLM v0.11 ``vllm/entrypoints/openai/protocol.py`` (error body
``{"error": {message, type, param, code}}``, ``TokenizeChatRequest`` fields).
"""

from __future__ import annotations

from typing import Any

import orjson

# Deepest JSON nesting a request may have. orjson reads 1024 levels but writes only 254, and
# the router re-serializes bodies, some inside its own wrapping (the hand-off legs), so a
# deeper body would end in a 500; 128 leaves room and is far beyond real requests.
MAX_JSON_DEPTH = 128

# Everything that shapes the chat template's output (vLLM v0.11 TokenizeChatRequest), sent to
# /tokenize as the client sent it so the ids equal a direct request's.
TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "tools",
)


def validate(body: Any, chat: bool) -> str | None:
    """Return an error message for bodies the router must refuse (400), else None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "'model' must be a string"
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty array"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a string 'role'"
            c = m.get("content")
            if (c is not None and not isinstance(c, str)) and (
                not isinstance(c, list) or not all(isinstance(p, dict) for p in c)
            ):
                return f"messages[{i}].content must be a string or an array of parts"
    else:
        p = body.get("prompt")
        ok = isinstance(p, str) or (
            isinstance(p, list)
            and p
            and (
                all(isinstance(x, str) for x in p)
                or all(type(x) is int for x in p)
                or all(isinstance(x, list) and all(type(t) is int for t in x) for x in p)
            )
        )
        if not ok:
            return "'prompt' must be a string, an array of strings or an array of token ids"
    for key in ("stream", "ignore_eos", "echo"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            return f"'{key}' must be a boolean"
    for key in ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens"):
        v = body.get(key)
        if v is not None and (type(v) is not int):
            return f"'{key}' must be an integer"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and v < 1:
            return f"'{key}' must be >= 1"
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            return f"'{key}' must be a number"
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return "'stream_options' must be an object"
    return None


def too_deep(raw: bytes, body: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if ``body`` (parsed from ``raw``) nests containers deeper than ``limit``."""
    # every container opens with a [ or { byte, so this few cannot nest deeper (C-speed count)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:  # iterative: the depth is what is being checked
        v, depth = todo.pop()
        children = v.values() if isinstance(v, dict) else v
        for c in children:
            if isinstance(c, dict | list):
                if depth >= limit:
                    return True
                todo.append((c, depth + 1))
    return False


def strip_handoff_fields(body: dict[str, Any]) -> bool:
    """Remove what a client sent to steer the KV hand-off (it belongs to the router alone):
    top-level ``kv_transfer_params`` and ``vllm_xargs.kv_transfer_params`` (vLLM merges
    ``vllm_xargs`` into ``SamplingParams.extra_args``, where its connectors read
    ``kv_transfer_params``; checked against vLLM's ``to_sampling_params``). True if changed."""
    changed = "kv_transfer_params" in body
    body.pop("kv_transfer_params", None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
        changed = True
    return changed


def is_batch(body: dict[str, Any], chat: bool) -> bool:
    """Several completions in one request: ``n > 1``, or a ``prompt`` that is a list of
    strings or of token lists with more than one entry (not one token list)."""
    n = body.get("n")
    if n is not None and n != 1:
        return True
    p = body.get("prompt")
    return not chat and isinstance(p, list) and len(p) > 1 and not all(type(t) is int for t in p)


def error_body(status: int, message: str, etype: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": None, "code": status}}
    )


def sse_error(message: str, etype: str = "upstream_error", code: int = 502) -> bytes:
    """An error event for a stream whose 200 headers are already sent."""
    return b"data: " + error_body(code, message, etype) + b"\n\n"


def error_detail(raw: bytes) -> tuple[str, str]:
    """(type, message) of an engine's OpenAI-format error answer; ("", "") when unreadable."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "", ""
    err = d.get("error", d) if isinstance(d, dict) else None  # older vLLM: top level
    msg = err.get("message") if isinstance(err, dict) else None
    etype = err.get("type") if isinstance(err, dict) else None
    return (etype if isinstance(etype, str) else ""), (msg if isinstance(msg, str) else "")


def tokenize_request(body: dict[str, Any], chat: bool, served: str) -> dict[str, Any]:
    """The engine ``/tokenize`` request counting this body's prompt."""
    if chat:
        req: dict[str, Any] = {
            "model": served,
            "messages": body["messages"],
            "add_generation_prompt": True,
        }
        for key in TEMPLATE_FIELDS:
            if key in body:
                req[key] = body[key]
        return req
    prompt = body.get("prompt")
    return {"model": served, "prompt": prompt[0] if isinstance(prompt, list) else prompt}


def answer(
    chat: bool, sid: str, created: int, model: str, text: str, finish: Any, usage: Any = False
) -> dict[str, Any]:
    """A whole answer (``usage`` given) or a stream chunk (``usage`` left out), in the
    chat or the completions shape."""
    chunk = usage is False
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["delta" if chunk else "message"] = {"role": "assistant", "content": text}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice["text"] = text
        obj = "text_completion"
    choice["logprobs"] = None
    choice["finish_reason"] = finish
    out = {"id": sid, "object": obj, "created": created, "model": model}
    out["choices"] = [choice]
    if not chunk:
        out["usage"] = usage
    return out


def completion_to_chat_chunk(chunk: dict[str, Any], rid: str) -> dict[str, Any]:
    """Rewrite a streamed ``text_completion`` chunk as a ``chat.completion.chunk``."""
    choices = []
    for c in chunk.get("choices") or []:
        choices.append(
            {
                "index": c.get("index", 0),
                "delta": {"content": c.get("text", "")},
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
        )
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": chunk.get("created"),
        "model": chunk.get("model"),
        "choices": choices,
    }
    if chunk.get("usage") is not None:
        out["usage"] = adjust_usage(chunk["usage"])
    return out


def adjust_usage(usage: Any) -> Any:
    """The decode leg saw the first token as prompt: move it back to the completion."""
    if not isinstance(usage, dict):
        return usage
    u = dict(usage)
    if isinstance(u.get("prompt_tokens"), int) and u["prompt_tokens"] > 0:
        u["prompt_tokens"] -= 1
    if isinstance(u.get("completion_tokens"), int):
        u["completion_tokens"] += 1
    return u


class SseEvents:
    """Split an SSE byte stream into whole events (``\\n\\n``-terminated), across chunks."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        return events
