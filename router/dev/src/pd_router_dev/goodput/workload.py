"""What the sweep sends, and when: prompt mixes, Poisson arrivals, multi-turn chat sessions and
the alternating mix. Every request is a streamed ``/v1/completions`` (chat sessions:
``/v1/chat/completions``) with ``ignore_eos``, so its output length is its ``max_tokens``.
Prompts are words drawn at random per request (seeded), so no two requests share a prefix
but a chat session's turns."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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
    "quickly",
    "river",
    "stone",
    "cloud",
    "paper",
    "garden",
    "window",
    "silver",
    "orange",
    "planet",
    "signal",
    "harbor",
]


@dataclass(frozen=True)
class Mix:
    """A prompt mix: the share of long prompts and the sizes, in tokens (``words_per_token``
    of the backend turns them into words)."""

    name: str
    long_share: float
    short_tokens: tuple[int, int] = (100, 300)
    long_tokens: tuple[int, int] = (2000, 3200)
    out_tokens: tuple[int, int] = (32, 96)


SHORT = Mix("short", 0.0)
MIXED = Mix("mixed-20%-long", 0.2)
LONG = Mix("long-heavy-60%", 0.6)
MIXES = (SHORT, MIXED, LONG)
LONGEST_SHORT = max(m.short_tokens[1] for m in MIXES)  # tokens (slo.Slo.of)


def unshared(req: Request, tag: str) -> Request:
    """``req`` as a configuration sends it: the same prompt behind a few words of its own
    (``tag``) and vLLM's ``cache_salt`` (in every KV block's identity), so that no
    configuration finds in the engines' prefix caches what another left there; a chat
    session's turns still share their conversation."""
    body = dict(req.body)
    body["cache_salt"] = tag
    if "prompt" in body:
        body["prompt"] = f"{tag}: {body['prompt']}"
    else:
        msgs = [dict(m) for m in body["messages"]]
        msgs[0]["content"] = f"{tag}: {msgs[0]['content']}"
        body["messages"] = msgs
    return Request(req.at, req.path, body, req.long, req.phase, req.session, req.turn)


@dataclass
class Request:
    at: float  # seconds after the cell's start
    path: str
    body: dict[str, Any]
    long: bool
    phase: str = ""  # the alternating workload's phase (its mix's name)
    session: int = -1  # a chat session's index; its later turns follow this one's answer
    turn: int = 0


@dataclass
class Session:
    """A multi-turn chat: a long first turn (a document and a question), then short follow-ups
    after a think time, each carrying the whole conversation so far."""

    index: int
    at: float
    turns: list[tuple[str, int]]  # (user message, max_tokens)
    think: float
    messages: list[dict[str, str]] = field(default_factory=list)


def text(rng: random.Random, tokens: int, words_per_token: float) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens * words_per_token))))


def one(
    rng: random.Random, mix: Mix, model: str, wpt: float, at: float, phase: str = ""
) -> Request:
    long = rng.random() < mix.long_share
    lo, hi = mix.long_tokens if long else mix.short_tokens
    body = {
        "model": model,
        "prompt": text(rng, rng.randint(lo, hi), wpt),
        "max_tokens": rng.randint(*mix.out_tokens),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Request(at, "/v1/completions", body, long, phase)


def poisson(
    mix: Mix, rate: float, duration: float, seed: int, model: str, wpt: float
) -> list[Request]:
    """Open-loop arrivals at ``rate`` per second for ``duration`` seconds."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(one(rng, mix, model, wpt, t))
        t += rng.expovariate(rate)
    return out


def alternating(
    phases: list[tuple[Mix, float]], phase_seconds: float, seed: int, model: str, wpt: float
) -> list[Request]:
    """Poisson arrivals whose mix (and rate) changes every ``phase_seconds``."""
    rng = random.Random(seed)
    out = []
    for i, (mix, rate) in enumerate(phases):
        start = i * phase_seconds
        t = start + rng.expovariate(rate)
        while t < start + phase_seconds:
            out.append(one(rng, mix, model, wpt, t, f"{i}:{mix.name}"))
            t += rng.expovariate(rate)
    return out


def sessions(rate: float, duration: float, seed: int, wpt: float, turns: int = 4) -> list[Session]:
    """Chat sessions starting at ``rate`` per second: a first turn of 1,500-2,500 tokens, then
    ``turns - 1`` follow-ups of 30-80 tokens, 0.5 s of thinking (mean, exponential) apart."""
    rng = random.Random(seed)
    out, t, i = [], rng.expovariate(rate), 0
    while t < duration:
        first = text(rng, rng.randint(1500, 2500), wpt)
        follow = [text(rng, rng.randint(30, 80), wpt) for _ in range(turns - 1)]
        out.append(
            Session(
                i,
                t,
                [(first, rng.randint(32, 64))] + [(f, rng.randint(32, 64)) for f in follow],
                0.5,
            )
        )
        t += rng.expovariate(rate)
        i += 1
    return out


def chat_request(s: Session, turn: int, model: str, at: float) -> Request:
    msg, out = s.turns[turn]
    s.messages.append({"role": "user", "content": msg})
    body = {
        "model": model,
        "messages": list(s.messages),
        "max_tokens": out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Request(at, "/v1/chat/completions", body, turn == 0, session=s.index, turn=turn)
