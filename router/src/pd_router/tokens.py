"""Prompt token counting for the routing decision (no I/O; the ladder is pd_router.decide).

Order (cheapest exact-enough first):
1. ``threshold == 0``: nothing to count (every request is disaggregated).
2. ``prompt`` given as token ids: its length.
3. A proven upper bound below the threshold: a BPE token covers at least one UTF-8 byte, so
   ``bytes(text) + template allowance`` bounds the count; below the threshold means direct
   without tokenizing at all (most short chat turns never pay for tokenization).
4. Local ``tokenizers`` tokenizer, plus the chat-template allowance: a file
   (``model.tokenizer``) or fetched once at start-up from a hub (``model.tokenizerHub``,
   pd_router.hub_tokenizer).
5. The engine's ``POST /tokenize`` (applies the real chat template; the ids are reused as the
   LMCache prefill prompt): ``pd_router.legs.Legs.tokenize``.
6. Estimate (bytes / 4) when nothing else answered; counted in ``pd_router_token_count``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson

from pd_router.config import ConfigError

log = logging.getLogger("pd_router.tokens")

TEMPLATE_BASE = 64  # allowance for chat-template tokens (system header, generation prompt)
TEMPLATE_PER_MESSAGE = 8


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    if chat:
        parts: list[str] = []
        for m in body["messages"]:
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                for p in c:
                    if isinstance(p, dict) and isinstance(p.get("text"), str):
                        parts.append(p["text"])
        return "\n".join(parts)
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list):
        return "\n".join(x for x in p if isinstance(x, str))
    return ""


def template_allowance(body: dict[str, Any], chat: bool) -> int:
    if not chat:
        return 4
    extra = TEMPLATE_BASE + TEMPLATE_PER_MESSAGE * len(body["messages"])
    for key in ("tools", "functions"):
        if body.get(key) is not None:
            extra += len(orjson.dumps(body[key]))
    return extra


def token_ids_prompt(body: dict[str, Any]) -> list[int] | None:
    p = body.get("prompt")
    if isinstance(p, list) and p and all(type(t) is int for t in p):
        return p
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
        inner = p[0]
        if inner and all(type(t) is int for t in inner):
            return inner
    return None


def load_local_tokenizer(spec: str) -> Any:
    """Load ``tokenizer.json`` from a file path or a directory containing it (at start-up;
    a path that does not hold a loadable tokenizer is a :class:`ConfigError` naming
    ``model.tokenizer``)."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for every failure
        msg = f"model.tokenizer: cannot load a tokenizer from {str(path)!r}: {exc}"
        raise ConfigError(msg) from None


def tokenizer_from_json(text: str, where: str) -> Any:
    """Parse a fetched ``tokenizer.json`` (ConfigError naming ``model.tokenizerHub``)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for every failure
        msg = f"model.tokenizerHub: {where} is not a loadable tokenizer.json: {exc}"
        raise ConfigError(msg) from None


class TokenCounter:
    def __init__(self, tokenizer_spec: str, served_name: str) -> None:
        self.served_name = served_name
        self.local = load_local_tokenizer(tokenizer_spec) if tokenizer_spec else None
        self.source = "file" if self.local is not None else "none"

    def use(self, tokenizer: Any, source: str) -> None:
        """Install a tokenizer obtained after construction (the hub fetch at start-up)."""
        self.local = tokenizer
        self.source = source

    def local_count(self, text: str, allowance: int) -> int:
        assert self.local is not None
        return len(self.local.encode(text, add_special_tokens=False).ids) + allowance
