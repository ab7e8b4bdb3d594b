"""What the real-engine tier needs of the engines' KV-cache events: how many batches an engine has
published (read with vLLM's own replay protocol) and a wait until a router has applied them all,
so a test decides its next prompt on what the engines hold, not on a race with their publishers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pd_router_dev.devstack import Proc
from pd_router_dev.sim.kv_events import published as replay_count

from tests.real_engine import engines

APPLIED = "pd_router_kv_event_batches_total"
STATE = "pd_router_kv_events_engines"
SETTLE_SECONDS = 30.0


def published(e: engines.Engine) -> int:
    """Batches ``e`` has published, from its replay ROUTER (vLLM 0.31.0 ZmqEventPublisher)."""
    return replay_count(f"tcp://127.0.0.1:{e.replay_port}")


def metric(router: Proc, name: str, **labels: str) -> float:
    return engines.value(engines.metrics_text(router.url()), name, **labels)


def until(what: str, cond: Any, timeout: float = SETTLE_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not {what} in {timeout:.0f} s"
        time.sleep(0.05)  # polling a condition with a deadline, not waiting a fixed time


def settle(routers: Sequence[Proc], live: Sequence[engines.Engine], retired: int = 0) -> None:
    """Every router has applied every batch the engines published (``retired``: the batches of
    engines replaced since the routers started, which they applied too)."""
    target = retired + sum(published(e) for e in live)
    for r in routers:
        until(f"{target} batches applied by {r.url()}", lambda r=r: metric(r, APPLIED, outcome="applied") >= target)
        assert metric(r, APPLIED, outcome="applied") == target
