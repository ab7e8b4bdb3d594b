"""Output-length fields of a request split into a prefill leg and a decode leg.

One place for the rules both hand-off protocols follow, checked against vLLM v0.11:
``CompletionRequest.max_tokens`` defaults to 16; chat defaults to what fits in the context
(``get_max_tokens``); ``SamplingParams._verify_args`` refuses ``min_tokens > max_tokens``.
"""

from __future__ import annotations

from typing import Any

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def requested_max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    mt = body.get("max_completion_tokens") if chat else None
    if mt is None:
        mt = body.get("max_tokens")
    return mt


def effective_max_tokens(
    body: dict[str, Any], chat: bool, prompt_len: int, max_model_len: int | None
) -> int | None:
    """The output length a direct request would get, so the split request gets the same:
    the client's value; else vLLM's defaults (completions: 16; chat: what fits in the
    context, ``max_model_len - prompt``). None when that cannot be known (no
    ``max_model_len`` from ``/tokenize``); the caller then serves the request directly.
    A model whose generation_config.json sets ``max_new_tokens`` lowers vLLM's chat default
    on both legs alike, so such requests may get one token more than directly."""
    mt = requested_max_tokens(body, chat)
    if mt is not None:
        return mt
    if not chat:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_model_len is None:
        return None
    return max(1, max_model_len - prompt_len)


def min_tokens_above(body: dict[str, Any], max_tokens: Any) -> bool:
    """The client asks for more tokens at least than at most: vLLM refuses it (400). Each
    split leg would look valid on its own, so such a request is not split."""
    mn = body.get("min_tokens")
    return type(mn) is int and type(max_tokens) is int and mn > max_tokens


def lower_min_tokens(req: dict[str, Any], produced: int, limit: int | None = None) -> None:
    """A leg that comes after ``produced`` tokens, or makes at most ``limit``, is asked for a
    correspondingly smaller ``min_tokens``. An invalid value (wrong type, negative) is left
    alone, so the engine answers it as it would a direct request."""
    mn = req.get("min_tokens")
    if type(mn) is not int or mn < 0:
        return
    mn = max(0, mn - produced)
    if limit is not None:
        mn = min(mn, limit)
    req["min_tokens"] = mn
