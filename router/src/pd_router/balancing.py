"""Endpoint choice: least outstanding work by power-of-two random choices, with optional
session affinity (rendezvous hashing of a header value over the healthy endpoints)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

from pd_router.discovery import Endpoint

_rand = random.Random()


def decode_load(ep: Endpoint) -> int:
    return ep.active


def prefill_load(ep: Endpoint) -> int:
    return ep.queued_tokens * 4 + ep.active


def _score(key: str, ep: Endpoint) -> bytes:
    data = f"{key}\x00{ep.base}".encode("utf-8", "surrogateescape")  # any header bytes
    return hashlib.blake2b(data, digest_size=8).digest()


def pick(
    candidates: Sequence[Endpoint],
    load: Callable[[Endpoint], int],
    affinity_key: str | None = None,
    exclude: Sequence[Endpoint] = (),
) -> Endpoint | None:
    """Pick one endpoint; ``None`` when no candidate remains."""
    eps = [e for e in candidates if e not in exclude] if exclude else candidates
    n = len(eps)
    if n == 0:
        return None
    if affinity_key:
        return max(eps, key=lambda e: _score(affinity_key, e))
    if n == 1:
        return eps[0]
    i = _rand.randrange(n)
    j = _rand.randrange(n - 1)
    if j >= i:
        j += 1
    a, b = eps[i], eps[j]
    return a if load(a) <= load(b) else b


def pair(
    decoders: Sequence[Endpoint],
    prefillers: Sequence[Endpoint],
    hint: Endpoint | None = None,
    affinity_key: str | None = None,
) -> tuple[Endpoint, Endpoint] | None:
    """A decoder and a prefiller of one KV revision (pd_router.revision.pairs): ``hint`` (the
    decision's decoder) when a prefiller of its revision is healthy, else the balancer's choice
    among the decoders that have one; None when no decoder has (both roles mid-rollout)."""
    revs = {p.revision for p in prefillers if p.revision is not None}
    if hint is not None and hint.revision in revs:
        dec: Endpoint | None = hint
    elif len(revs) == 1 and all(d.revision in revs for d in decoders):
        dec = pick(decoders, decode_load, affinity_key)  # one revision live: the common case
    else:
        dec = pick([d for d in decoders if d.revision in revs], decode_load, affinity_key)
    if dec is None:
        return None
    pre = pick([p for p in prefillers if p.revision == dec.revision], prefill_load)
    assert pre is not None  # dec.revision is in revs
    return dec, pre
