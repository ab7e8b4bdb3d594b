"""Hand-off health per (prefiller, decoder) pair, apart from each engine's serving health.

A NIXL hand-off that the decoder answered with a failure (vLLM fails a request whose KV load
failed: a 500, or a stream that ends before its first token) says that this pair cannot hand
off now: the prefiller's side channel is out of the decoder's reach, the prefiller restarted
under a new engine id, a NIC is down. It does not say that either engine cannot serve. Counted
against the prefiller's serving health, as before, it ejected engines of the flexible layout
from serving, and a decoder that could pull from nobody stayed in every pair. So, per pair:

- **quarantine**: ``health.passiveFailureThreshold`` failed hand-offs in a row take the pair
  out of hand-offs for ``health.ejectionSeconds``, doubled with each failure after that, up to
  ``maxEjectionSeconds`` (the engines' ejection figures); a failure while it is out (a
  hand-off sent before) adds nothing. The goodput decision weighs only the pairs that are in;
  the other decisions' pairing skips it, and where no other pair is left, long prompts are
  served whole (fallback ``handoff_failing``). Once the time is up the pair takes hand-offs
  again; one that succeeds ends the run of failures, one that fails puts it out for twice as
  long.
- **abandon what waits**: streamed hand-offs still waiting on the pair for their first token are
  abandoned when one fails, and the router serves them whole at once. (Not answers that are not
  streamed: vLLM sends their headers only when they are complete, so one still waiting for its
  KV cannot be told from one decoding, which abandoning would throw away.) Measured on vLLM
  0.31's CPU build with the side channel blocked and an unknown engine id in every hand-off
  (tests/real_engine/tamper.py before it named one per arming): the hand-offs waiting on one
  decoder failed one at a time, 5 s apart (the handshake's ZMQ ``RCVTIMEO`` 5000,
  ``nixl/base_worker.py:1065``, one handshake thread per decoder), so the third waited 15 s.
  Hand-offs naming one engine id share its handshake and fail together; several prefillers out
  of a decoder's reach still queue.

A pair is keyed by both engines' address and generation (``Endpoint.generation``, bumped each
time an engine is admitted again), so an engine that comes back pairs afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pd_router.config import Health

if TYPE_CHECKING:
    from pd_router.discovery import Endpoint

log = logging.getLogger("pd_router.pairs")

Key = tuple[str, int, str, int]


def key(prefiller: Endpoint, decoder: Endpoint) -> Key:
    return (prefiller.base, prefiller.generation, decoder.base, decoder.generation)


class Waiting:
    """A hand-off's decode leg that waits for its answer to begin; :meth:`HandoffPairs.failed`
    abandons it (its scope times out now)."""

    __slots__ = ("abandoned", "scope")

    def __init__(self, scope: asyncio.Timeout) -> None:
        self.scope = scope
        self.abandoned = False

    def abandon(self) -> None:
        self.abandoned = True
        self.scope.reschedule(asyncio.get_running_loop().time())


class _Run:
    __slots__ = ("failures", "last", "until")

    def __init__(self) -> None:
        self.failures = 0  # failed hand-offs in a row (while the pair was in)
        self.last = 0.0  # monotonic time of the last one
        self.until = 0.0  # monotonic time before which the pair takes no hand-off


class HandoffPairs:
    def __init__(self, health: Health) -> None:
        self.health = health
        self._runs: dict[Key, _Run] = {}  # pairs whose last hand-off failed
        self._waiting: dict[Key, set[Waiting]] = {}
        self._out_until = 0.0  # the latest quarantine's end: none is out after it

    @property
    def any_out(self) -> bool:
        """Whether some pair may be out now (without it none is: a fast path's test)."""
        return self._out_until > 0.0 and time.monotonic() < self._out_until

    def usable(self, prefiller: Endpoint, decoder: Endpoint) -> bool:
        """Whether the pair may take a hand-off now (not quarantined)."""
        if not self._runs:
            return True
        run = self._runs.get(key(prefiller, decoder))
        return run is None or time.monotonic() >= run.until

    @contextmanager
    def waiting(self, prefiller: Endpoint, decoder: Endpoint) -> Iterator[Waiting]:
        """Register a streamed hand-off's decode leg until its first token: run it inside
        ``async with w.scope``; a ``TimeoutError`` with ``w.abandoned`` set means it was
        abandoned. (Not an answer that is not streamed: vLLM sends its headers only once it
        is complete, so nothing tells one still waiting for its KV from one decoding it.)"""
        k = key(prefiller, decoder)
        w = Waiting(asyncio.timeout(None))
        waiting = self._waiting.setdefault(k, set())
        waiting.add(w)
        try:
            yield w
        finally:
            waiting.discard(w)
            if not waiting and self._waiting.get(k) is waiting:
                del self._waiting[k]

    def ok(self, prefiller: Endpoint, decoder: Endpoint) -> None:
        """A hand-off on the pair succeeded (the decoder read the KV): its run of failures ends."""
        if not self._runs:
            return
        run = self._runs.pop(key(prefiller, decoder), None)
        if run is not None and run.until:
            log.info("hand-offs from %s to %s succeed again", prefiller.base, decoder.base)

    def failed(self, prefiller: Endpoint, decoder: Endpoint, why: str, rid: str = "") -> int:
        """A hand-off on the pair failed: one more toward its quarantine (a failure while it
        is out, of a hand-off sent before, adds nothing), and the others waiting on it are
        abandoned. Returns how many were abandoned."""
        k = key(prefiller, decoder)
        now = time.monotonic()
        self._forget_stale(now)
        run = self._runs.get(k)
        if run is None:
            run = self._runs[k] = _Run()
        run.last = now
        outcome = "the pair is out already"
        if now >= run.until:
            run.failures += 1
            nth = run.failures - self.health.passive_failure_threshold + 1
            outcome = f"{run.failures} in a row"
            if nth >= 1:
                out = self.health.ejection_for(nth)
                run.until = now + out
                self._out_until = max(self._out_until, run.until)
                outcome += f": the pair takes no hand-off for {out:.0f} s"
        abandoned = [w for w in self._waiting.get(k, ()) if not w.abandoned]
        for w in abandoned:
            w.abandon()
        log.warning(
            "hand-off from prefiller %s to decoder %s failed (%s), %s; %d waiting on it served "
            "whole",
            prefiller.base,
            decoder.base,
            why,
            outcome,
            len(abandoned),
            extra={"request_id": rid} if rid else None,
        )
        return len(abandoned)

    def _forget_stale(self, now: float) -> None:
        """Drop the runs of pairs that have not failed for ``maxEjectionSeconds`` and are not
        out (an engine gone, or back under a new generation): they would only grow the table."""
        if len(self._runs) < 64:
            return
        old = now - self.health.max_ejection_seconds
        for k in [k for k, r in self._runs.items() if r.last < old and r.until <= now]:
            del self._runs[k]
