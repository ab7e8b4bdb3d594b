"""A stalled engine (issue 36, item 2): its processes stopped (SIGSTOP), the router finds it
within ``health.stallSeconds`` and its health check, ejects it, fails what waits on it at once
and serves what it can elsewhere; resumed, the engine is re-admitted by its checks. The
timeouts here (``firstByteSeconds``, ``streamIdleSeconds``) are far longer than the client's, so
only the stall watch can end these requests in time: without it each test fails on the
client's timeout."""

from __future__ import annotations

import http.client
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack
from router_testlib import metric_value, post_json, wait_until, write_config

# the engines' token steps: a stream of STREAM_TOKENS lasts about 20 s
STEP_MS = 10
STREAM_TOKENS = 2000


@pytest.fixture(scope="module")
def engines(stack: Stack) -> tuple[Proc, Proc]:
    step = ("--decode-step-ms", str(STEP_MS), "--slow-factor", "1")
    return stack.sim("stall-a", *step), stack.sim("stall-b", *step)


@pytest.fixture(scope="module")
def router(stack: Stack, engines: tuple[Proc, Proc]) -> Proc:
    urls = [e.url() for e in engines]
    cfg: dict[str, Any] = {
        # every request whole on a decoder; NIXL's route, so the demo config's LMCache
        # notification port (7500, fixed) is not bound: another test may hold it
        "routing": {"threshold": 100000, "connector": "nixl"},
        "pools": {
            "prefill": {"discovery": "static", "static": urls[:1]},
            "decode": {"discovery": "static", "static": urls},
        },
        "timeouts": {"firstByteSeconds": 600, "streamIdleSeconds": 600},
        # only the stall watch ejects: no passive or active threshold is reached in a test
        "health": {
            "stallSeconds": 1,
            "intervalSeconds": 1,
            "timeoutSeconds": 1,
            "unhealthyThreshold": 1000,
            "passiveFailureThreshold": 1000,
            "ejectionSeconds": 1,
        },
    }
    r = stack.router("stall-router", write_config(stack.workdir, "stall-router", cfg))
    wait_until(lambda: _healthy(r) == 2, "both decoders admitted")
    return r


def _healthy(router: Proc) -> float:
    return metric_value(router.url(), "pd_router_healthy_endpoints", {"pool": "decode"})


def _stalls(router: Proc) -> float:
    return metric_value(router.url(), "pd_router_engine_stalls_total", {"pool": "decode"})


@contextmanager
def stopped(*procs: Proc) -> Iterator[None]:
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)


def test_requests_waiting_on_a_stopped_engine_are_served_by_the_other(
    router: Proc, engines: tuple[Proc, Proc]
) -> None:
    stalls = _stalls(router)
    url = router.url() + "/v1/chat/completions"

    def ask(i: int) -> tuple[int, Any, dict]:
        body = {"messages": [{"role": "user", "content": f"question {i} " * 8}], "max_tokens": 4}
        return post_json(url, body)

    with stopped(engines[0]), ThreadPoolExecutor(6) as pool:
        # the router does not know yet: the balancer sends some of these to the stopped engine
        answers = list(pool.map(ask, range(6)))
        assert [status for status, _, _ in answers] == [200] * 6, answers
        assert _stalls(router) == stalls + 1
        assert _healthy(router) == 1  # ejected while it stays stopped
    # resumed: its checks re-admit it once its ejection is over
    wait_until(lambda: _healthy(router) == 2, "the resumed engine re-admitted")


def test_a_stream_from_a_stopped_engine_ends_with_an_error_event(
    router: Proc, engines: tuple[Proc, Proc]
) -> None:
    wait_until(lambda: _healthy(router) == 2, "both decoders admitted")
    stalls = _stalls(router)
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    # both stopped once the stream has begun (whichever serves it): nothing can take it over
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        status = resp.status
        first = resp.readline()
        started = first.startswith(b"data: ")
        with stopped(*engines):
            data = first + resp.read()  # to the end of the stream, or the client's timeout
    finally:
        conn.close()
    assert status == 200 and started
    events = [e for e in data.split(b"\n\n") if e]
    assert b"[DONE]" not in events[-1]
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["type"] == "upstream_error"
    assert len(events) < STREAM_TOKENS
    assert _stalls(router) >= stalls + 1
    wait_until(lambda: _healthy(router) == 2, "both resumed engines re-admitted")
