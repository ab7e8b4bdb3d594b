"""OpenAI / vLLM wire shapes: what a request body must look like, what the router strips from
it, the error body, and the answers and stream chunks the router builds itself (the LMCache
route, whose decode leg is a ``/v1/completions`` request). No I/O.

Shapes checked against vLLM v0.11 ``vllm/entrypoints/openai/protocol.py`` (error body
``{"error": {message, type, param, code}}``, ``TokenizeChatRequest`` fields); the answers the
LMCache route builds, the model cards and the endpoint list against vLLM 0.31.0 (paths
relative to its ``vllm/`` package, named where used; 0.33.0 checked where it says so).
"""

from __future__ import annotations

import os
import time
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


def batch_reason(body: dict[str, Any], chat: bool) -> str | None:
    """Why a request holds several completions, or None: ``"n"`` (``n > 1``) or
    ``"prompts"`` (a ``prompt`` that is a list of strings or of token lists with more than
    one entry; one token list is one prompt). The hand-offs carry one sequence, so these
    are served directly (``pd_router_batch_requests_total{reason}``)."""
    n = body.get("n")
    if n is not None and n != 1:
        return "n"
    p = body.get("prompt")
    if not chat and isinstance(p, list) and len(p) > 1 and not all(type(t) is int for t in p):
        return "prompts"
    return None


def is_batch(body: dict[str, Any], chat: bool) -> bool:
    """Several completions in one request (:func:`batch_reason`)."""
    return batch_reason(body, chat) is not None


def error_body(status: int, message: str, etype: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": param, "code": status}}
    )


def model_not_found(model: str) -> bytes:
    """vLLM's 404 for a model it does not serve (serve/engine/serving.py ``_check_model``
    and openai/models/serving.py, 0.31.0: ``NotFoundError``, ``param: "model"``)."""
    return error_body(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


# ---------------------------------------------------------------------- other endpoints
# The rest of vLLM 0.31.0's OpenAI server (entrypoints/launchers/api_server/routers.py
# register_api_routers and the api_router.py each one attaches), relayed to a decoder as
# they are (POST, body unchanged). Which of them an engine answers depends on its model and
# flags; one it lacks answers FastAPI's 404 (``{"detail": "Not Found"}``), passed on.
PASSTHROUGH_PATHS = (
    # generate models (generate/api_router.py)
    "/v1/responses",  # openai/responses/api_router.py
    "/v1/chat/completions/batch",  # openai/chat_completion/api_router.py
    "/v1/messages",  # anthropic/api_router.py
    "/v1/messages/count_tokens",
    "/cohere/v2/chat",  # cohere/api_router.py (VLLM_ENABLE_COHERE_API)
    "/generative_scoring",  # generate/generative_scoring/api_router.py
    # every model (serve/__init__.py register_vllm_serve_api_routers)
    "/tokenize",  # serve/tokenize/api_router.py
    "/detokenize",
    # pooling models (pooling/factories.py, by the model's pooling task)
    "/pooling",  # pooling/pooling/api_router.py
    "/classify",  # pooling/classify/api_router.py
    "/v1/embeddings",  # pooling/embed/api_router.py
    "/v2/embed",
    "/score",  # pooling/scoring/api_router.py
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    # speech-to-text models (speech_to_text/factories.py; multipart bodies)
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    # --enable-scale-out (scale_out/factories.py)
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
)
# Not relayed, because their state lives in one engine and a pool of decoders has no
# single answer: GET /v1/responses/{id} and POST /v1/responses/{id}/cancel (the response
# store, off by default: VLLM_ENABLE_RESPONSES_API_STORE), /v1/load_lora_adapter,
# /v1/unload_lora_adapter, /start_profile, /stop_profile, /abort_requests, /load,
# /version, /kv_event_sources, /ping, /invocations (SageMaker), the VLLM_SERVER_DEV_MODE,
# elastic-EP and fault-tolerance routes; nor the WebSocket /v1/realtime.


# ---------------------------------------------------------------------- /v1/models
def model_card(model: str, max_model_len: int | None, created: int) -> dict[str, Any]:
    """The router's own card when no engine answered /v1/models: vLLM's ``ModelCard``
    fields (serve/engine/protocol.py, 0.31.0) with what the router knows."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": None,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }


def served_cards(answer: Any, model: str) -> list[dict[str, Any]]:
    """The cards of ``model`` in an engine's /v1/models answer (a ``ModelList``), as the
    engine wrote them; [] when there is none. LoRA adapters the engine lists are left out:
    the router serves ``model.servedName`` only."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return []
    return [c for c in data if isinstance(c, dict) and c.get("id") == model]


def sse_error(message: str, etype: str = "upstream_error", code: int = 502) -> bytes:
    """An error event for a stream whose 200 headers are already sent."""
    return b"data: " + error_body(code, message, etype) + b"\n\n"


# The two APIs whose streams the router reads (chat and text completions).
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
# What a choice of a stream chunk carries once the answer has begun (vLLM 0.31.0
# chat_completion/serving.py and completion/serving.py chunk shapes).
_BEGUN_DELTA = ("content", "reasoning", "reasoning_content", "tool_calls", "function_call")


def stream_opening(head: bytes) -> str:
    """How far the first bytes of an engine's SSE answer go: ``began`` (a token, a finish, an
    error or anything the router does not read: relay it), ``empty`` (the stream ended before
    any of that), or ``more`` (only vLLM's opening chunks so far: the role, or nothing).

    vLLM 0.31.0 streams a chat answer's role in a chunk of its own, and when a request fails
    after that (a NIXL KV load that fails under ``kv_load_failure_policy: fail``) it sends that
    chunk and ``[DONE]``, status 200, no token and no finish_reason: relayed as it came, the
    client would take an empty answer for a complete one."""
    for event in head.split(b"\n\n")[:-1]:  # complete events only
        data = event.strip()
        if not data.startswith(b"data:"):
            continue  # an SSE comment or field the router does not interpret
        data = data[5:].strip()
        if data == b"[DONE]":
            return "empty"
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "began"
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list) or "error" in chunk:
            return "began"
        for choice in choices:  # none: the usage chunk
            if not isinstance(choice, dict) or choice.get("text"):
                return "began"
            if choice.get("finish_reason") is not None:
                return "began"
            delta = choice.get("delta")
            if isinstance(delta, dict) and any(delta.get(k) for k in _BEGUN_DELTA):
                return "began"
    return "more"


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


# ---------------------------------------------------------------------- LMCache answers
# The LMCache route's legs are ``/v1/completions`` requests of token ids; what the client
# gets is rebuilt from their ``text_completion`` answers in the shape vLLM gives the same
# request directly: CompletionResponse / ChatCompletionResponse and their stream chunks
# (openai/{completion,chat_completion}/protocol.py, serving.py of vLLM 0.31.0; 0.33.0 adds
# ``weight_versions`` to the choices, carried over from the leg like every choice field).


def new_completion_id(chat: bool) -> str:
    """A fresh id in vLLM's format, ``chatcmpl-``/``cmpl-`` + ``random_uuid()`` (16 hex
    characters, vllm/utils/__init__.py, 0.31.0), for the answers the router builds itself.
    (vLLM itself, and so the direct and NIXL routes, name a completion after the request's
    ``X-Request-Id`` when one is sent: serve/engine/serving.py ``_base_request_id``.)"""
    return ("chatcmpl-" if chat else "cmpl-") + os.urandom(8).hex()


def chat_message(text: str) -> dict[str, Any]:
    """``ChatMessage`` as vLLM dumps an assistant answer (chat_completion/protocol.py,
    0.31.0 and 0.33.0): no ``tool_calls`` (its serializer drops an empty list), ``reasoning``
    null (requests with tools, and every chat request of a reasoning model, are served
    directly: lmcache.py)."""
    return {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }


# CompletionResponseChoice fields that ChatCompletionResponse has at the top level instead
_PROMPT_FIELDS = ("prompt_logprobs", "prompt_token_ids")
_CHAT_ONLY_TOP = (*_PROMPT_FIELDS, "prompt_text")


def whole_answer(
    chat: bool, sid: str, model: str, leg: dict[str, Any], text: str, usage: Any
) -> dict[str, Any]:
    """The client's whole answer built on a leg's ``text_completion`` answer (the decode
    leg's; the prefill leg's when its one token is the answer): every field the engine
    wrote, with our id, the whole ``text`` and ``usage``; in the chat shape for chat. The
    leg's ``kv_transfer_params`` are the hand-off's, so the client gets null, like a direct
    answer. Raises KeyError/IndexError/TypeError/AttributeError on a malformed leg."""
    ch = leg["choices"][0]
    if not isinstance(ch, dict):
        raise TypeError("choice is not an object")
    out: dict[str, Any] = {
        "id": sid,
        "object": "chat.completion" if chat else "text_completion",
        "created": leg.get("created", int(time.time())),
        "model": model,
    }
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": chat_message(text)}
        choice.update((k, v) for k, v in ch.items() if k not in ("index", "text", *_PROMPT_FIELDS))
        # chat_completion_full_generator: ``output.finish_reason or "stop"``
        choice["finish_reason"] = choice.get("finish_reason") or "stop"
    else:
        choice = {**ch, "index": 0, "text": text}
    out["choices"] = [choice]
    for k, v in leg.items():
        if k in out or k == "choices":
            continue
        out[k] = usage if k == "usage" else None if k == "kv_transfer_params" else v
        if chat and k == "usage":
            out.update(dict.fromkeys(_CHAT_ONLY_TOP))
    out.setdefault("usage", usage)
    if chat:
        for k in _CHAT_ONLY_TOP:
            out.setdefault(k, None)
    return out


def role_chunk(sid: str, created: int, model: str, usage: Any = None) -> dict[str, Any]:
    """The chat stream's first chunk (chat_completion_stream_generator, 0.31.0): the role
    and empty content, ``prompt_token_ids``/``prompt_text`` set to null (the chunk is dumped
    ``exclude_unset``); with ``continuous_usage_stats`` its usage (0 completion tokens)."""
    out: dict[str, Any] = {
        "id": sid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if usage is not None:
        out["usage"] = usage
    out.update(prompt_token_ids=None, prompt_text=None)
    return out


def token_chunk(
    chat: bool,
    sid: str,
    created: int,
    model: str,
    text: str,
    finish: Any,
    stop_reason: Any = None,
    usage: Any = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """A stream chunk of one output token, as vLLM 0.31.0 dumps it (``exclude_unset``):
    completions always carry ``stop_reason``, ``prompt_token_ids`` and ``token_ids``; chat
    ``token_ids``, and ``stop_reason`` once finished. ``usage``: continuous usage stats;
    ``fingerprint``: on a finishing chunk when no usage chunk follows."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = None
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    out: dict[str, Any] = {
        "id": sid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        out["usage"] = usage
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    return out


def usage_chunk(
    chat: bool, sid: str, created: int, model: str, usage: dict[str, Any], fingerprint: Any
) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage and the
    fingerprint, dumped ``exclude_none`` (both stream generators, 0.31.0)."""
    out: dict[str, Any] = {
        "id": sid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": {k: v for k, v in usage.items() if v is not None},
    }
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    return out


def stream_usage(prompt: int, completion: int, chat: bool) -> dict[str, Any]:
    """Continuous usage stats of one chunk: chat sets ``completion_tokens_details`` (to
    null without reasoning), completions leave it unset."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if chat:
        u["completion_tokens_details"] = None
    return u


def relabel_chunk(
    d: dict[str, Any], chat: bool, sid: str, created: int, model: str
) -> dict[str, Any]:
    """A decode-leg ``text_completion`` chunk as the client's: our id, ``created`` and
    model, the first token moved from the prompt to the completion in its usage, and for
    chat the ``chat.completion.chunk`` shape (``delta``, ``stop_reason`` once finished).
    An error event (no ``choices``) is passed on as the engine sent it."""
    if "choices" not in d:
        return d
    if not chat:
        out = {**d, "id": sid, "created": created, "model": model}
    else:
        choices = []
        for c in d["choices"] or []:
            fr = c.get("finish_reason")
            ch: dict[str, Any] = {
                "index": c.get("index", 0),
                "delta": {"content": c.get("text", "")},
                "logprobs": None,
                "finish_reason": fr,
            }
            if fr is not None:
                ch["stop_reason"] = c.get("stop_reason")
            if "token_ids" in c:
                ch["token_ids"] = c["token_ids"]
            choices.append(ch)
        out = {
            "id": sid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        out.update((k, v) for k, v in d.items() if k not in out and k != "object")
    usage = d.get("usage")
    if isinstance(usage, dict):
        u = adjust_usage(usage)
        if chat and out["choices"] and "completion_tokens_details" not in u:
            u["completion_tokens_details"] = None  # chat sets it on per-chunk usage
        out["usage"] = u
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
