"""Passive ejection (pd_router.discovery): an endpoint ejected for failed requests stays out for
health.ejectionSeconds, doubled with each ejection in a row up to maxEjectionSeconds, whatever its
active check says, and a request it serves well resets that."""

from __future__ import annotations

import pytest

from pd_router import discovery
from pd_router.config import Health, Pool


def test_ejection_time_doubles_in_a_row_and_resets_on_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(discovery.time, "monotonic", lambda: now[0])
    pool = discovery.EndpointPool(
        "prefill",
        Pool(discovery="static"),
        Health(passive_failure_threshold=1, ejection_seconds=10, max_ejection_seconds=25),
    )
    (ep,) = pool.set_endpoints(["http://127.0.0.1:9001"])
    pool._record_check(ep, True)
    assert ep.healthy

    def ejected_for() -> float:
        pool.report_failure(ep)
        assert not ep.healthy
        out = ep.ejected_until - now[0]
        pool._record_check(ep, True)  # a passing check inside the ejection re-admits nothing
        assert not ep.healthy
        now[0] = ep.ejected_until
        pool._record_check(ep, True)  # ... and once it is over, one does
        assert ep.healthy
        return out

    assert [ejected_for() for _ in range(3)] == [10, 20, 25]
    pool.report_success(ep)  # it served a request well
    assert ejected_for() == 10
