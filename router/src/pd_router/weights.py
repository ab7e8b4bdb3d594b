"""Weights identity at admission: engines of one KV revision must hold the same weights.

The KV revision (pd_router.revision) hashes what the chart renders, ``model.revision`` among it;
left empty, that is the hub's moving default branch, so two pods started on either side of an
upstream push load other weights under one name and one revision. NIXL's handshake does not
tell (its hash covers the ``--model`` string: ``compute_nixl_compatibility_hash``, vLLM
0.31.0-0.33.0), and measured on vLLM's CPU build a prefiller on other weights under the same
name paired with a decoder: 8 of 8 answers 200, 0 of 8 right, and the decoder's prefix cache
poisoned afterwards.

So each time an engine comes up healthy (pd_router.discovery, with its revision) the router
asks it one fixed greedy completion of one token with its top ``TOP`` logprobs
(``PROBE_PROMPT``) and
places the answer in the revision's **weight sets** (:class:`WeightSets`, one per router,
across both pools): the first set seen is 0, an answer that matches none starts another. Engines
are paired only within one revision and one weight set (``Endpoint.pairing``); a request whose
only same-revision partners hold other weights is served whole (fallback ``weights_differ``),
the log names both engines, and ``pd_router_weight_set_endpoints{pool, revision, weights}``
counts the healthy engines per set (the chart's alert ``PDInferenceWeightsDiffer`` fires where
one revision has two sets).

Two answers match when, both carrying logprobs, at least ``COMMON`` of their top tokens are
shared with logprobs within ``TOLERANCE`` nats and their first tokens are the same or each in
the other's top (a near tie may swap from one batch to the next): engines on the same weights
agree to rounding (other GPUs, another batch), other weights (another seed, a fine-tune) share
almost nothing of a top 5 over a vocabulary of thousands (the simulator's figures, drawn from
its weights' seed, behave alike). Engines that return no logprobs are compared on the token
alone.

The probe waits up to ``PROBE_SECONDS`` (or ``health.timeoutSeconds`` if longer): it is often an
engine's first request, which on vLLM's CPU build took 2.4-3 s (its warm-up) against 20 ms
after, longer than the health check's 2 s. The engine's admission waits for it, and so does
that round of its pool's health checks. Decision, written down: not a
majority vote: the engines of the set seen first keep pairing while the rest pair among
themselves, so a rollout half done pairs within each half, and nothing decides which weights are
"right" (the log and the alert ask a person).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pd_router.revision import UNKNOWN

# The probe (vLLM 0.31.0 /v1/completions: ``logprobs`` an int up to the engine's
# ``max_logprobs``, 20 by default; ``top_logprobs`` a list of {token text: logprob} per token)
PROBE_PROMPT = "pd-inference weights check: the quick brown fox jumps over the lazy dog"
TOP = 5
COMMON = 3  # top tokens two answers must share, where both carry logprobs
TOLERANCE = 0.15  # nats between their logprobs
MAX_SETS = 16  # weight sets kept per revision; an engine beyond them pairs with nothing
PROBE_SECONDS = 30.0


def probe_body(model: str) -> dict[str, Any]:
    """The probe for an engine serving ``model`` ("": its one model, vLLM's default)."""
    body: dict[str, Any] = {
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": TOP,
    }
    if model:
        body["model"] = model
    return body


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """An engine's answer to the probe: its first token and, where it says them, its top
    tokens' logprobs."""

    token: str
    top: tuple[tuple[str, float], ...] = ()

    def matches(self, other: Fingerprint) -> bool:
        if not self.top or not other.top:
            return self.token == other.token
        theirs, ours = dict(other.top), dict(self.top)
        common = [(lp, theirs[t]) for t, lp in self.top if t in theirs]
        if len(common) < min(COMMON, len(self.top), len(other.top)):
            return False
        if any(abs(a - b) > TOLERANCE for a, b in common):
            return False
        # two top tokens within rounding of each other may swap places from one batch to the
        # next: the greedy token may differ where each is in the other's top
        return self.token == other.token or (self.token in theirs and other.token in ours)

    def __str__(self) -> str:
        top = ", ".join(f"{t!r} {lp:.3f}" for t, lp in self.top[:3])
        return f"{self.token!r}" + (f" ({top})" if top else "")


def from_answer(answer: Any) -> Fingerprint:
    """The fingerprint in a /v1/completions answer to :func:`probe_body`. Raises ValueError
    for an answer of another shape."""
    try:
        choice = answer["choices"][0]
        token = choice["text"]
        lp = choice.get("logprobs")
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"not a completion: {exc!r}") from None
    if not isinstance(token, str):
        raise ValueError("not a completion: choices[0].text is not a string")
    if not lp:
        return Fingerprint(token)
    tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
    first = tops[0] if isinstance(tops, list) and tops else None
    if not isinstance(first, dict):
        raise ValueError("logprobs without top_logprobs")
    top = []
    for t, v in first.items():
        if isinstance(t, str) and isinstance(v, int | float) and math.isfinite(v):
            top.append((t, float(v)))
    top.sort(key=lambda tv: -tv[1])
    return Fingerprint(token, tuple(top))


@dataclass(slots=True)
class _Set:
    fingerprint: Fingerprint
    first: str  # the engine it was first seen on (named in the log)


@dataclass(slots=True)
class WeightSets:
    """The weight sets seen per KV revision, shared by every pool of one router process."""

    sets: dict[str, list[_Set]] = field(default_factory=dict)

    def place(self, revision: str, base: str, fp: Fingerprint) -> tuple[int | None, str]:
        """The set ``fp`` belongs to in ``revision`` (a new one when it matches none; None past
        ``MAX_SETS``) and the engine set 0 was first seen on."""
        known = self.sets.setdefault(revision, [])
        for i, s in enumerate(known):
            if s.fingerprint.matches(fp):
                return i, known[0].first
        if len(known) >= MAX_SETS:
            return None, known[0].first
        known.append(_Set(fp, base))
        return len(known) - 1, known[0].first

    def first(self, revision: str, index: int) -> Fingerprint:
        return self.sets[revision][index].fingerprint


def census(endpoints: Iterable[Any]) -> dict[tuple[str, str], int]:
    """Endpoints by (revision, weight set), ``UNKNOWN`` for either not read yet."""
    return dict(
        Counter(
            (
                UNKNOWN if e.revision is None else e.revision,
                UNKNOWN if e.weights is None else str(e.weights),
            )
            for e in endpoints
        )
    )
