"""The answers the LMCache route builds itself. Its legs are ``/v1/completions`` requests of
token ids; what the client gets is rebuilt from their ``text_completion`` answers in the shape
vLLM gives the same request directly: CompletionResponse / ChatCompletionResponse and their
stream chunks (openai/{completion,chat_completion}/protocol.py, serving.py of vLLM 0.31.0;
0.33.0 adds ``weight_versions`` to the choices, carried over from the leg like every choice
field). No I/O.
"""

from __future__ import annotations

import os
import time
from typing import Any


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
