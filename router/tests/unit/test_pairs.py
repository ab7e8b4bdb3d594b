"""Hand-off health per (prefiller, decoder) pair (pd_router.pairs): a failed hand-off
quarantines its pair alone, for the ejection figures, doubled in a row and ended by a success;
an engine back under a new generation pairs afresh; the hand-offs waiting on the failed pair are
abandoned, and those on other pairs are not; the pairing skips a quarantined pair."""

from __future__ import annotations

import asyncio

import pytest

from pd_router import balancing, pairs
from pd_router.config import Health
from pd_router.discovery import Endpoint
from pd_router.pairs import HandoffPairs


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(pairs.time, "monotonic", c)
    return c


def engines(*names: str) -> list[Endpoint]:
    out = []
    for n in names:
        ep = Endpoint(f"http://{n}:8000")
        ep.revision, ep.generation = "r1", 1
        out.append(ep)
    return out


def test_a_failed_handoff_quarantines_its_pair_alone_doubling_until_one_succeeds(
    clock: Clock,
) -> None:
    hp = HandoffPairs(
        Health(passive_failure_threshold=2, ejection_seconds=10, max_ejection_seconds=25)
    )
    p, q, d, e = engines("p", "q", "d", "e")
    assert not hp.any_out and hp.usable(p, d)
    hp.failed(p, d, "5xx")
    assert hp.usable(p, d)  # one failure: still in (passiveFailureThreshold 2)
    hp.failed(p, d, "5xx")
    assert hp.any_out and not hp.usable(p, d)
    # negative controls: the other pairs of both engines hand off as before
    assert hp.usable(q, d) and hp.usable(p, e)
    clock.t += 9.9
    assert not hp.usable(p, d)
    clock.t += 0.2
    assert hp.usable(p, d)  # its next hand-off is the probe
    hp.failed(p, d, "stream")  # failed again: twice as long
    clock.t += 19.9
    assert not hp.usable(p, d)
    clock.t += 0.2
    assert hp.usable(p, d)
    hp.failed(p, d, "5xx")  # 40 s capped at maxEjectionSeconds
    clock.t += 25.1
    assert hp.usable(p, d)
    hp.ok(p, d)  # a hand-off read its KV: the run ends
    assert not hp.any_out
    hp.failed(p, d, "5xx")
    assert hp.usable(p, d)  # a new run: one failure is not enough
    hp.failed(p, d, "5xx")
    clock.t += 10.1
    assert hp.usable(p, d)  # back to ejectionSeconds


def test_an_engine_back_under_a_new_generation_pairs_afresh(clock: Clock) -> None:
    hp = HandoffPairs(Health(passive_failure_threshold=1, ejection_seconds=30))
    p, d = engines("p", "d")
    hp.failed(p, d, "5xx")
    assert not hp.usable(p, d)
    p.generation += 1  # re-admitted: it may have restarted (a new NIXL engine id)
    assert hp.usable(p, d)


def test_a_failure_abandons_what_waits_on_its_pair_and_nothing_else() -> None:
    hp = HandoffPairs(Health())
    p, d, e = engines("p", "d", "e")

    async def leg(decoder: Endpoint, started: asyncio.Event) -> str:
        with hp.waiting(p, decoder) as w:
            try:
                async with w.scope:
                    started.set()
                    await asyncio.sleep(3600)  # its decoder waits for a handshake
            except TimeoutError:
                assert w.abandoned
                return "abandoned"
        return "answered"

    async def main() -> tuple[list[str], bool]:
        marks = [asyncio.Event() for _ in range(3)]
        legs = [asyncio.create_task(leg(x, m)) for x, m in zip((d, d, e), marks, strict=True)]
        for m in marks:
            await m.wait()
        assert hp.failed(p, d, "5xx") == 2
        done = [await asyncio.wait_for(t, 5) for t in legs[:2]]
        other_waits = not legs[2].done()
        legs[2].cancel()
        return done, other_waits

    done, other_waits = asyncio.run(main())
    assert done == ["abandoned", "abandoned"]
    assert other_waits  # the leg on (p, e) is not abandoned
    assert not hp._waiting  # nothing left registered


def test_the_pairing_skips_a_quarantined_pair_and_finds_none_when_every_pair_is(
    clock: Clock,
) -> None:
    hp = HandoffPairs(Health(passive_failure_threshold=1))
    p, q, d = engines("p", "q", "d")
    hp.failed(p, d, "5xx")
    for _ in range(20):  # the balancer's choice is random: every draw must avoid (p, d)
        assert balancing.pair([d], [p, q], usable=hp.usable) == (d, q)
    # the decision's prefiller is passed over when its pair is quarantined
    assert balancing.pair([d], [p, q], prefill_hint=p, usable=hp.usable) == (d, q)
    hp.failed(q, d, "5xx")
    assert balancing.pair([d], [p, q], usable=hp.usable) is None
    # negative control: without the pairs' health the pair is there
    assert balancing.pair([d], [p], usable=None) == (d, p)


def test_failures_while_the_pair_is_out_add_nothing_and_it_comes_back_in(clock: Clock) -> None:
    """Hand-offs sent before the pair went out fail after it did (vLLM's 5 s handshake each):
    they neither lengthen the quarantine nor count toward the next, as an ejected engine's
    failures do not (discovery.report_failure)."""
    hp = HandoffPairs(Health(passive_failure_threshold=1, ejection_seconds=10))
    p, d = engines("p", "d")
    hp.failed(p, d, "5xx")
    for _ in range(4):
        clock.t += 1
        hp.failed(p, d, "5xx")
    clock.t += 6.1  # 10 s after the first failure
    assert hp.usable(p, d) and not hp.any_out
    hp.failed(p, d, "5xx")  # the second failure counted: 20 s
    clock.t += 19.9
    assert not hp.usable(p, d) and hp.any_out
    # negative control: had each failure counted, it would be out for 160 s more


def test_only_runs_long_over_are_forgotten(clock: Clock) -> None:
    """Past 64 runs the table drops those of pairs that have not failed for maxEjectionSeconds
    and are not out, never a run still counting toward its threshold."""
    hp = HandoffPairs(Health(passive_failure_threshold=2, max_ejection_seconds=300))
    p, d = engines("p", "d")
    for i in range(70):  # old runs of pairs long gone
        (q,) = engines(f"q{i}")
        hp.failed(q, d, "5xx")
    clock.t += 301
    hp.failed(p, d, "5xx")  # one in a row: the old runs go, not this one
    assert len(hp._runs) == 1
    hp.failed(p, d, "5xx")
    assert not hp.usable(p, d)
