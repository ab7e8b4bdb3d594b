"""Several worker processes on one port (listen.workers): every request served, metrics
aggregated over the workers whichever answers the scrape, graceful stop, a worker's death
stops the pod, and the configurations that cannot share the port refused."""

from __future__ import annotations

import http.client
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_router import workers
from pd_router.config import ConfigError, parse_config
from pd_router.workers import share, worker_count
from pd_router_dev.devstack import Proc, Stack
from router_testlib import MODEL, long_text, metric_value, wait_until, write_config


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def post_fresh_connection(port: int, prompt: str) -> tuple[int, str]:
    """One request on a new connection (the kernel spreads connections over the workers)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = f'{{"model": "{MODEL}", "prompt": "{prompt}", "max_tokens": 4}}'
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, r.getheader("x-pd-route") or ""
    finally:
        c.close()


@pytest.fixture(scope="module")
def engines(stack: Stack) -> tuple[Proc, Proc]:
    return stack.sim("wk-prefill", "--kv-connector", "nixl"), stack.sim(
        "wk-decode", "--kv-connector", "nixl"
    )


def start(stack: Stack, engines: tuple[Proc, Proc], name: str, workers: int) -> Proc:
    pre, dec = engines
    cfg = {
        "listen": {"workers": workers},
        "routing": {
            "connector": "nixl",
            "threshold": 256,
            "decision": "length",
        },  # the hand-off under test, not the decision (test_router_decision.py)
        "pools": {
            "prefill": {"discovery": "static", "static": [pre.url()]},
            "decode": {"discovery": "static", "static": [dec.url()]},
        },
        "limits": {"maxInFlight": 7, "maxQueued": 3},
    }
    return stack.router(name, write_config(stack.workdir, name, cfg))


@pytest.fixture(scope="module")
def router(stack: Stack, engines: tuple[Proc, Proc]) -> Iterator[Proc]:
    r = start(stack, engines, "wk-router", 2)
    wait_until(lambda: metric_value(r.url(), "pd_router_healthy_endpoints") == 2, "healthy")
    yield r


def test_two_workers_serve_every_request_and_report_all_of_them(router: Proc) -> None:
    assert len(children(router.pid)) == 2
    routes = [post_fresh_connection(router.port, "hi") for _ in range(40)]
    routes += [post_fresh_connection(router.port, long_text(400)) for _ in range(24)]
    assert routes == [(200, "direct")] * 40 + [(200, "disaggregated")] * 24
    # whichever worker answers the scrape reports both workers' requests
    for _ in range(6):
        assert metric_value(router.url(), "pd_router_requests_total", {"outcome": "ok"}) == 64
    assert metric_value(router.url(), "pd_router_handoff_wait_seconds_count") == 24


def test_sigterm_stops_every_worker_and_exits_0(stack: Stack, engines: tuple[Proc, Proc]) -> None:
    r = start(stack, engines, "wk-stop", 2)
    workers = children(r.pid)
    assert len(workers) == 2
    r.popen.send_signal(signal.SIGTERM)
    assert r.popen.wait(30) == 0
    assert not any(Path(f"/proc/{w}").exists() for w in workers)


def test_a_dying_worker_stops_the_pod(stack: Stack, engines: tuple[Proc, Proc]) -> None:
    r = start(stack, engines, "wk-crash", 2)
    first, second = children(r.pid)
    os.kill(first, signal.SIGKILL)
    assert r.popen.wait(30) != 0
    wait_until(
        lambda: (
            not Path(f"/proc/{second}/stat").exists()
            or "Z" in Path(f"/proc/{second}/stat").read_text().split()[2]
        ),
        "second worker gone",
    )
    assert "stopping the others" in r.log_tail()


def test_workers_share_the_admission_limits() -> None:
    cfg = parse_config({"limits": {"maxInFlight": 7, "maxQueued": 3}})
    assert (share(cfg, 2).limits.max_in_flight, share(cfg, 2).limits.max_queued) == (4, 2)


def test_auto_workers_with_the_router_notification_socket_is_one() -> None:
    lmcache = {"routing": {"connector": "lmcache"}}  # notificationReceiver router, the default
    assert worker_count(parse_config({"listen": {"workers": 0}, **lmcache})) == 1
    assert worker_count(parse_config(lmcache)) == 1


@pytest.mark.parametrize(
    ("cpu_max", "v1", "expected"),
    [
        ("150000 100000", None, 2),  # 1.5 CPUs: rounded up
        ("50000 100000", None, 1),
        ("max 100000", None, "all"),  # no quota: the CPUs it may run on
        (None, ("300000", "100000"), 3),  # cgroup v1
        (None, ("-1", "100000"), "all"),
    ],
)
def test_auto_workers_follow_the_cpu_limit(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cpu_max: str | None,
    v1: tuple | None,
    expected: int | str,
) -> None:
    monkeypatch.setattr(workers, "CGROUP_V2_CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(workers, "CGROUP_V1_QUOTA", tmp_path / "quota")
    monkeypatch.setattr(workers, "CGROUP_V1_PERIOD", tmp_path / "period")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    if v1 is not None:
        (tmp_path / "quota").write_text(v1[0])
        (tmp_path / "period").write_text(v1[1])
    sidecar = parse_config(
        {"listen": {"workers": 0}, "lmcache": {"notificationReceiver": "prefillSidecar"}}
    )
    assert worker_count(sidecar) == (4 if expected == "all" else expected)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"listen": {"workers": 2}, "routing": {"connector": "lmcache"}},
            "listen.workers: must be 1 with lmcache.notificationReceiver",
        ),
        ({"listen": {"workers": -1}}, "listen.workers: must be between 0"),
        ({"listen": {"workers": 65}}, "listen.workers: must be between 0"),
    ],
)
def test_workers_that_cannot_share_the_port_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data)
