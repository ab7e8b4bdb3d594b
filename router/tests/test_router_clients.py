"""Hostile clients below the JSON level: malformed HTTP that must not put secrets into the log
or flood it, and connections that send nothing, or a head too slowly, or idle forever."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack
from router_testlib import http_call, post_json, wait_until, write_config


@pytest.fixture(scope="module")
def engines(stack: Stack) -> tuple[Proc, Proc]:
    return stack.sim("cl-prefill", "--kv-connector", "nixl"), stack.sim(
        "cl-decode", "--kv-connector", "nixl"
    )


def _router(stack: Stack, engines: tuple[Proc, Proc], name: str, over: dict[str, Any]) -> Proc:
    pre, dec = engines
    cfg = {
        "routing": {"connector": "nixl", "threshold": 100000},  # every request direct
        "pools": {
            "prefill": {"discovery": "static", "static": [pre.url()]},
            "decode": {"discovery": "static", "static": [dec.url()]},
        },
        "logging": {"level": "info"},
        **over,
    }
    return stack.router(name, write_config(stack.workdir, name, cfg))


@pytest.fixture(scope="module")
def head_router(stack: Stack, engines: tuple[Proc, Proc]) -> Iterator[Proc]:
    """1 s for a new connection's first request head; keep-alive idle far longer, so what
    closes a connection here is the head deadline."""
    timeouts = {"clientHeaderSeconds": 1, "clientIdleSeconds": 60}
    yield _router(stack, engines, "cl-head", {"timeouts": timeouts})


@pytest.fixture(scope="module")
def idle_router(stack: Stack, engines: tuple[Proc, Proc]) -> Iterator[Proc]:
    timeouts = {"clientHeaderSeconds": 60, "clientIdleSeconds": 1}
    yield _router(stack, engines, "cl-idle", {"timeouts": timeouts})


def _read_until_closed(sock: socket.socket, deadline_s: float = 10) -> tuple[bytes, bool]:
    """Everything the router sends, and whether it closed the connection within the deadline
    (the deadline only stops a broken test)."""
    sock.settimeout(deadline_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return got, False
    except ConnectionResetError:
        pass
    return got, True


def _send(port: int, *parts: bytes) -> bytes:
    """Send ``parts`` on a new connection; the router's answer (it closes after a 400)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for p in parts:
            try:
                s.sendall(p)
            except (BrokenPipeError, ConnectionResetError):
                break  # it answered and closed already
        got, closed = _read_until_closed(s, 30)
    assert closed
    return got


def _log_lines(router: Proc, start: int = 0) -> list[dict[str, Any]]:
    text = router.log.read_bytes()[start:].decode(errors="replace")
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def _good_request(router: Proc) -> str:
    rid = "good-" + uuid.uuid4().hex
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, _ = post_json(router.url() + "/v1/chat/completions", body, {"X-Request-Id": rid})
    assert status == 200
    wait_until(
        lambda: any(x.get("request_id") == rid for x in _log_lines(router)),
        "the good request's log line",
    )
    return rid


def test_malformed_requests_never_log_keys_or_prompts(
    stack: Stack, engines: tuple[Proc, Proc]
) -> None:
    """aiohttp's parser errors quote the request bytes; aiohttp logged them with a traceback
    (the key of a malformed Authorization line, the prompt of a broken chunked body)."""
    router = _router(stack, engines, "cl-logs", {})
    key = "sk-" + uuid.uuid4().hex
    prompt = "zebra-" + uuid.uuid4().hex
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    chunk = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
    for parts in (
        (head + b"Authorization: Bearer %s\x01\r\nContent-Length: 2\r\n\r\n{}" % key.encode(),),
        (head + b"Authorization Bearer %s\r\nContent-Length: 2\r\n\r\n{}" % key.encode(),),
        (head + b"Authorization: Bearer %s%s\r\n\r\n" % (key.encode(), b"a" * 9000),),
        # a chunk longer than its size line says, with the head alone first and all at once
        (head + b"Transfer-Encoding: chunked\r\n\r\n", b"10\r\n" + chunk + b"\r\n0\r\n\r\n"),
        (head + b"Transfer-Encoding: chunked\r\n\r\n10\r\n" + chunk + b"\r\n0\r\n\r\n",),
        (head + b"Transfer-Encoding: chunked\r\n\r\nzz " + chunk + b"\r\n",),
    ):
        assert _send(router.port, *parts).split(b" ", 2)[1] == b"400", parts
    rid = _good_request(router)  # logged after every line of the requests above
    wait_until(lambda: rid in router.log.read_text(errors="replace"), "the request line")
    log = router.log.read_text(errors="replace")
    assert key not in log and prompt not in log
    lines = _log_lines(router)
    assert any(x["msg"] == "request" and x.get("request_id") == rid for x in lines)
    refused = [x for x in lines if x["logger"] == "pd_router.http"]
    assert refused, "the refusals are still logged"
    for x in refused:  # one short line each: the class and the status, no traceback
        assert "exc" not in x and x["level"] == "warning", x
        assert x["msg"].startswith("refused a malformed HTTP request from 127.0.0.1: "), x


def test_a_flood_of_malformed_requests_logs_a_bounded_number_of_lines(
    stack: Stack, engines: tuple[Proc, Proc]
) -> None:
    router = _router(stack, engines, "cl-flood", {})
    _good_request(router)
    start = router.log.stat().st_size
    bad = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\x01\r\n\r\n"
    t0 = time.monotonic()
    for _ in range(100):
        assert _send(router.port, bad).split(b" ", 2)[1] == b"400"
    elapsed = time.monotonic() - t0
    _good_request(router)
    lines = [x for x in _log_lines(router, start) if x["logger"] == "pd_router.http"]
    assert lines, "the first refusals are logged"
    # 10 a window of 10 s per message: the burst may straddle a window boundary; the bound
    # grows with how long the burst took so that a slow machine is no failure
    assert len(lines) <= 10 * (2 + int(elapsed // 10)), (len(lines), elapsed)


@pytest.mark.parametrize("which", ["head", "idle"])
def test_a_connection_that_sends_nothing_is_closed(
    head_router: Proc, idle_router: Proc, which: str
) -> None:
    router = head_router if which == "head" else idle_router
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as s:
        got, closed = _read_until_closed(s)
    assert closed and got == b""


def test_a_connection_that_sends_half_a_request_line_is_closed(head_router: Proc) -> None:
    with socket.create_connection(("127.0.0.1", head_router.port), timeout=30) as s:
        s.sendall(b"GET /heal")
        got, closed = _read_until_closed(s)
    assert closed and got == b""


def test_an_idle_keep_alive_connection_is_closed(idle_router: Proc) -> None:
    with socket.create_connection(("127.0.0.1", idle_router.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # HTTP/1.1: keep-alive
        got, closed = _read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 200") and b'{"status":"ok"}' in got
    assert closed


@pytest.mark.parametrize("which", ["head", "idle"])
def test_a_slow_but_complete_client_is_served(
    head_router: Proc, idle_router: Proc, which: str
) -> None:
    """Neither deadline runs while a request is being read or answered: the head deadline
    ends once a whole head arrived, and the body may come later (it has clientBodySeconds)."""
    router = head_router if which == "head" else idle_router
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as s:
        s.sendall(head[:20])
        s.sendall(head[20:])
        # the body is late, past the 1 s deadline: the connection must stay open meanwhile
        s.settimeout(2.5)
        with pytest.raises(TimeoutError):
            s.recv(1)
        s.sendall(body)
        s.settimeout(30)
        got = s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
    status, _, _ = http_call(router.url() + "/health")
    assert status == 200
