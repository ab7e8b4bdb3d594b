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
    prefill_hint: Endpoint | None = None,
    usable: Callable[[Endpoint, Endpoint], bool] | None = None,
) -> tuple[Endpoint, Endpoint] | None:
    """A decoder and a prefiller of one KV revision and weight set (``Endpoint.pairing``:
    pd_router.revision, pd_router.weights), never one engine for both (a flexible pool's
    engines are in both lists), and only a pair that ``usable(prefiller, decoder)`` allows
    (pd_router.pairs: not quarantined for failed hand-offs; None: every pair): ``hint`` (the
    decision's decoder) when a prefiller it pairs with is healthy, else the balancer's choice
    among the decoders that have one; ``prefill_hint`` (the decision's prefiller) when it is
    healthy and pairs with the decoder, else the balancer's. None when no decoder has one (both
    roles mid-rollout, or every pair quarantined)."""
    keys = {p.pairing for p in prefillers if p.pairing is not None}

    def pairs(p: Endpoint, d: Endpoint) -> bool:
        return p is not d and p.pairing == d.pairing and (usable is None or usable(p, d))

    def paired(d: Endpoint) -> bool:
        return any(pairs(p, d) for p in prefillers)

    # a flexible pool passes its one list as both (every engine in both roles)
    split = decoders is not prefillers
    if hint is not None and hint.pairing in keys and hint in decoders and paired(hint):
        dec: Endpoint | None = hint
    elif split and usable is None and len(keys) == 1 and all(d.pairing in keys for d in decoders):
        dec = pick(decoders, decode_load, affinity_key)  # one revision live: the common case
    else:
        eps = [d for d in decoders if d.pairing in keys and paired(d)]
        dec = pick(eps, decode_load, affinity_key)
    if dec is None:
        return None
    if prefill_hint is not None and prefill_hint in prefillers and pairs(prefill_hint, dec):
        return dec, prefill_hint
    pre = pick([p for p in prefillers if pairs(p, dec)], prefill_load)
    assert pre is not None  # paired(dec)
    return dec, pre
