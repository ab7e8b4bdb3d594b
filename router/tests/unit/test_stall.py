"""pd_router.stall: the health check of a silent engine is asked ``timeoutSeconds`` before the
silence reaches ``stallSeconds``, and the engine is stalled only once both hold: the check
failed and the silence lasted ``stallSeconds``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pd_router.config import Health
from pd_router.discovery import Endpoint
from pd_router.stall import StallWatch

STALL, TIMEOUT = 0.4, 0.3  # the check asked 0.1 s into the silence


class Up:
    """The upstream client as the watch reads it: one call waiting, ``heard`` bytes so far."""

    def __init__(self) -> None:
        self.heard = 7
        self.aborted: list[tuple[str, int, bool]] = []

    def waiting_on(self, host: str, port: int, tls: bool) -> tuple[int, int]:
        return 1, self.heard

    def abort(self, host: str, port: int, tls: bool, exc: Exception) -> int:
        self.aborted.append((host, port, tls))
        return 1


class Pool:
    name = "prefill"

    def __init__(self, ep: Endpoint, answer: bool, on_probe: Any = None) -> None:
        self.endpoints = {ep.base: ep}
        self.answer, self.on_probe = answer, on_probe
        self.asked: list[float] = []
        self.ejected: list[Endpoint] = []

    async def probe(self, ep: Endpoint) -> bool:
        self.asked.append(time.monotonic())
        if self.on_probe:
            self.on_probe()
        return self.answer

    def eject(self, ep: Endpoint, why: str) -> None:
        self.ejected.append(ep)


def watch(
    answer: bool, on_probe: Any = None, stall: float = STALL
) -> tuple[StallWatch, Up, Pool, list[str]]:
    up, stalls = Up(), []
    pool = Pool(Endpoint("http://10.0.0.1:8000"), answer, on_probe)
    health = Health(stall_seconds=stall, timeout_seconds=TIMEOUT)
    w = StallWatch(up, [pool], health, stalls.append)  # type: ignore[arg-type]
    return w, up, pool, stalls


async def _silence(w: StallWatch, pool: Pool) -> float:
    """Looks at 0, 0.05 and 0.11 s of fake silence; the check is asked at the last."""
    t0 = time.monotonic()
    w.look(t0)
    w.look(t0 + 0.05)
    await asyncio.sleep(0)  # let a task started by mistake run
    assert not pool.asked, "asked before stallSeconds - timeoutSeconds"
    w.look(t0 + STALL - TIMEOUT + 0.01)
    await asyncio.gather(*w._tasks)
    return t0


def test_a_silent_engine_failing_its_check_is_stalled_when_the_silence_reaches_stall_seconds() -> (
    None
):
    async def main() -> None:
        w, up, pool, stalls = watch(answer=False)
        t0 = await _silence(w, pool)
        assert len(pool.asked) == 1
        # the check failed at once (a refused connection): the watch waited out the silence
        assert time.monotonic() >= t0 + STALL
        assert pool.ejected and stalls == ["prefill"] and up.aborted == [("10.0.0.1", 8000, False)]

    asyncio.run(main())


def test_an_engine_answering_its_check_or_speaking_meanwhile_is_not_stalled() -> None:
    async def main() -> None:
        w, up, pool, stalls = watch(answer=True)
        await _silence(w, pool)
        assert pool.asked and not pool.ejected and not stalls and not up.aborted
        # its check fails, but it sends something before the silence reaches stallSeconds
        w, up, pool, stalls = watch(answer=False)
        pool.on_probe = lambda: asyncio.get_running_loop().call_later(0.05, setattr, up, "heard", 8)
        await _silence(w, pool)
        assert pool.asked and not pool.ejected and not stalls and not up.aborted

    asyncio.run(main())


def test_a_silent_engine_answering_its_checks_is_asked_once_per_stall_seconds() -> None:
    """A long prefill or an answer not streamed: silent, healthy. After a check passed, the
    next comes ``stallSeconds`` later, not at every look past ``stallSeconds - timeoutSeconds``
    (nor at every look where that is 0); once it speaks, its silence counts afresh."""

    async def main() -> None:
        w, up, pool, _ = watch(answer=True)
        await _silence(w, pool)
        asked = pool.asked[0]
        for dt in (0.05, 0.2, STALL - 0.01):  # within stallSeconds of the passing check
            w.look(asked + dt)
            await asyncio.gather(*w._tasks)
        assert len(pool.asked) == 1
        w.look(asked + STALL + 0.01)
        await asyncio.gather(*w._tasks)
        assert len(pool.asked) == 2
        # it speaks: a new silence, asked stallSeconds - timeoutSeconds into it
        up.heard += 1
        t = time.monotonic()
        w.look(t)
        w.look(t + STALL - TIMEOUT + 0.01)
        await asyncio.gather(*w._tasks)
        assert len(pool.asked) == 3
        # stallSeconds no longer than the timeout: no look asks twice within stallSeconds
        w, up, pool, _ = watch(answer=True, stall=TIMEOUT)
        t0 = time.monotonic()
        for dt in (0.0, 0.01, 0.02, 0.03):
            w.look(t0 + dt)
            await asyncio.gather(*w._tasks)
        assert len(pool.asked) == 1

    asyncio.run(main())
