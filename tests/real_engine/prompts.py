"""Prompts and callers of the real-engine tier: texts made from a seed (each test its own, so no
prompt is in an engine's prefix cache before the test sends it), the official ``openai`` client
through the router, and the decoder asked directly for the colocated answer."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import openai

WORDS = [
    "the",
    "router",
    "sends",
    "a",
    "long",
    "prompt",
    "to",
    "the",
    "prefiller",
    "and",
    "the",
    "decoder",
    "pulls",
    "its",
    "cache",
    "block",
    "by",
    "block",
    "while",
    "short",
    "prompts",
    "go",
    "straight",
    "to",
    "a",
    "decoder",
    "that",
    "streams",
    "every",
    "token",
    "of",
    "the",
    "answer",
    "back",
]
MAX_TOKENS = 24


def text(seed: int | str, words: int) -> str:
    r = random.Random(str(seed))
    return " ".join(r.choice(WORDS) for _ in range(words))


LONG_WORDS = 700  # about 1,400 tokens of the tiny tokenizer: over the dev threshold (512)
SHORT_WORDS = 20


@dataclass
class Answer:
    text: str
    route: str
    reason: str
    prompt_tokens: int | None
    finish: str | None
    kv_revision: str = ""  # x-pd-kv-revision: the KV revision of the decoder that answered
    cached: str = ""  # x-pd-cached-tokens: "<tokens>; source=events|approximate"
    ttft: float = 0.0  # a stream's: seconds from the request to its first text, at the client

    @property
    def cached_tokens(self) -> int:
        return int(self.cached.split(";")[0]) if self.cached else 0

    @property
    def cached_source(self) -> str:
        return self.cached.partition("source=")[2]


def client(base: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)


def ask(base: str, model: str, chat: bool, prompt: str | list[dict[str, Any]], stream: bool, **extra: Any) -> Answer:
    """One greedy request through ``base`` (router or engine) with the official client."""
    c = client(base)
    args: dict[str, Any] = {
        "model": model,
        "max_tokens": extra.pop("max_tokens", MAX_TOKENS),
        "temperature": 0,
        **extra,
    }
    if chat:
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        create: Any = (
            c.chat.completions.with_streaming_response.create if stream else c.chat.completions.with_raw_response.create
        )
        args["messages"] = msgs
    else:
        create = c.completions.with_streaming_response.create if stream else c.completions.with_raw_response.create
        args["prompt"] = prompt
    if stream:
        args["stream_options"] = {"include_usage": True}
        parts: list[str] = []
        usage, finish, ttft = None, None, 0.0
        t0 = time.perf_counter()
        with create(stream=True, **args) as r:
            route, reason = r.headers.get("x-pd-route", ""), r.headers.get("x-pd-reason", "")
            rev = r.headers.get("x-pd-kv-revision", "")
            cached = r.headers.get("x-pd-cached-tokens", "")
            for chunk in r.parse():
                if chunk.usage is not None:
                    usage = chunk.usage.prompt_tokens
                for ch in chunk.choices:
                    piece = ch.delta.content if chat else ch.text
                    if piece and not ttft:
                        ttft = time.perf_counter() - t0
                    parts.append(piece or "")
                    finish = ch.finish_reason or finish
        return Answer("".join(parts), route, reason, usage, finish, rev, cached, ttft)
    raw = create(**args)
    out = raw.parse()
    ch = out.choices[0]
    body = ch.message.content if chat else ch.text
    return Answer(
        body or "",
        raw.headers.get("x-pd-route", ""),
        raw.headers.get("x-pd-reason", ""),
        out.usage.prompt_tokens,
        ch.finish_reason,
        raw.headers.get("x-pd-kv-revision", ""),
        raw.headers.get("x-pd-cached-tokens", ""),
    )


def colocated(decoder_url: str, model: str, chat: bool, prompt: str | list[dict[str, Any]], **extra: Any) -> Answer:
    """The decoder's own answer, computed there: a fresh ``cache_salt`` keeps it off the prefix
    cache (whatever earlier requests left there, KV that came by NIXL included)."""
    return ask(decoder_url, model, chat, prompt, False, extra_body={"cache_salt": uuid.uuid4().hex}, **extra)
