"""Stalled engines (``health.stallSeconds``): found within seconds, not at a request's timeout.

An engine that has calls waiting on it and has sent the router nothing for ``stallSeconds``
while its health check (``health.path`` within ``health.timeoutSeconds``) failed is stalled.
The check is asked ``timeoutSeconds`` before the silence reaches ``stallSeconds``, so that its
timeout runs out as the silence does: a stall is found ``stallSeconds`` after the engine's last
byte (plus a look's period; ``timeoutSeconds`` where that is longer), not ``stallSeconds +
timeoutSeconds`` (5 + 2 s by default: with the check asked after the silence, the real-engine
churn test's in-flight requests took up to 10.3 s to end, 2026-12-07, against issue 36's
10 s). A silent engine that answers its check (a long prefill, an answer not streamed) is
asked again at most once per ``stallSeconds``. A stalled engine (its processes stopped, a
frozen host, a path that drops packets without a reset) is ejected at once, as after passive
failures (``health.ejectionSeconds``, doubled with each ejection in a row, then re-admitted by
its checks), and every call waiting on it fails now with
:class:`pd_router.upstream.EngineStalled`, a timeout. So a decoder leg that sent the
client nothing is retried on another decoder, a prefill falls back to serving whole, and a
stream already relayed ends with its error event, instead of each waiting out
``firstByteSeconds`` or ``streamIdleSeconds`` (300 s and 120 s by default).

An engine that is only slow (a long prefill, an answer not streamed) still answers its health
check: vLLM serves ``/health`` from its API server process, which asks the engine core nothing
(``AsyncLLM.check_health`` checks only that the core has not died; vllm/v1/engine/async_llm.py,
0.31.0 and 0.33.0). The other side of that: an engine core that hangs while its API server runs
(a wedged GPU) answers ``/health`` and is not found here; its calls end at their timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from pd_router.config import Health
from pd_router.discovery import Endpoint, EndpointPool
from pd_router.upstream import EngineStalled, UpstreamClient

log = logging.getLogger("pd_router.stall")

# Looks per stallSeconds: a stall is found within stallSeconds x (1 + 1/LOOKS).
LOOKS = 10


class StallWatch:
    """Looks at every engine of ``pools`` every ``stallSeconds / LOOKS``, at most a second apart."""

    def __init__(
        self,
        up: UpstreamClient,
        pools: Sequence[EndpointPool],
        health: Health,
        on_stall: Callable[[str], None],
    ) -> None:
        self.up = up
        self.pools = pools
        self.seconds = health.stall_seconds
        # the check is asked this long into the silence: its timeout ends with stallSeconds
        self.ask_after = max(0.0, self.seconds - health.timeout_seconds)
        self.period = min(1.0, self.seconds / LOOKS)
        self.on_stall = on_stall  # told the pool's name of each stall found
        # per engine (host, port, tls): (its count of what it sent and was sent, since when)
        self._quiet: dict[tuple[str, int, bool], tuple[int, float]] = {}
        self._asking: set[tuple[str, int, bool]] = set()
        # per engine silent since its last check passed: not asked again before this time (a
        # slow engine answering its checks is asked once per stallSeconds, not per look)
        self._rested: dict[tuple[str, int, bool], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)  # the watch's period, not a synchronisation
            self.look(time.monotonic())

    def look(self, now: float) -> None:
        """Start a health check of each engine silent with calls waiting for ``stallSeconds``
        less the check's timeout."""
        where: dict[tuple[str, int, bool], list[tuple[EndpointPool, Endpoint]]] = {}
        for pool in self.pools:
            for ep in list(pool.endpoints.values()):
                where.setdefault((ep.host, ep.port, ep.tls), []).append((pool, ep))
        for key, held in where.items():
            waiting, heard = self.up.waiting_on(*key)
            quiet = self._quiet.get(key)
            if not waiting or quiet is None or quiet[0] != heard:
                self._quiet[key] = (heard, now)
                self._rested.pop(key, None)
            elif (
                now - quiet[1] >= self.ask_after
                and now >= self._rested.get(key, 0.0)
                and key not in self._asking
            ):
                self._asking.add(key)
                task = asyncio.get_running_loop().create_task(self._ask(held, key, heard, quiet[1]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        for key in self._quiet.keys() - where.keys():
            del self._quiet[key]
            self._rested.pop(key, None)

    async def _ask(
        self,
        held: list[tuple[EndpointPool, Endpoint]],
        key: tuple[str, int, bool],
        heard: int,
        since: float,
    ) -> None:
        """Ask the engine (in each pool that holds it) its health check; failed, and silent
        ``stallSeconds`` since ``since`` (waited for, if the check failed before: a refused
        connection fails at once), eject it from each and fail what waits on it."""
        pool, ep = held[0]
        try:
            ok = await pool.probe(ep)
            if not ok:
                left = since + self.seconds - time.monotonic()
                if left > 0:
                    await asyncio.sleep(left)  # the rest of the silence that makes a stall
            waiting, now_heard = self.up.waiting_on(*key)
            if ok or now_heard != heard or not waiting:
                now = time.monotonic()
                if now_heard == heard and waiting:  # silent still, but answering its checks
                    self._rested[key] = now + self.seconds
                self._quiet[key] = (now_heard, now)  # alive: another stallSeconds
                return
            for pool, ep in held:
                why = f"silent {self.seconds:g} s with calls waiting, its health check failed"
                pool.eject(ep, why)
                self.on_stall(pool.name)
            failed = self.up.abort(*key, EngineStalled(f"engine {ep.base} stalled"))
            self._quiet.pop(key, None)
            log.warning("%s stalled: %d calls on it failed", ep.base, failed)
        finally:
            self._asking.discard(key)

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
