"""A decoder that fails after its response headers (body cut short, stream cut, stream or
body stalled): the router answers in OpenAI's error format or ends the SSE stream with an
error event, closes the engine's connection, and never hangs. The decoder here is a raw
socket server in the test, misbehaving on purpose."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack
from router_testlib import http_call, metric_value, post_json, write_config

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class BadEngine(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.closed_by_router = threading.Semaphore(0)  # one release per stalled request


class _Handler(socketserver.StreamRequestHandler):
    server: BadEngine

    def _request(self) -> tuple[str, bytes] | None:
        line = self.rfile.readline()
        if not line:
            return None
        length = 0
        while (h := self.rfile.readline()) not in (b"\r\n", b""):
            name, _, value = h.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return line.split(b" ")[1].decode(), self.rfile.read(length)

    def handle(self) -> None:
        while (req := self._request()) is not None:
            path, body = req
            if path == "/health":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                continue
            mode = json.loads(body)["messages"][0]["content"]
            if mode == "cut-body":
                self.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"partial')
                return
            if mode == "cut-stream":
                self.wfile.write(SSE_HEAD + _chunk(EVENT))
                return
            if mode == "stall-body":
                self.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"partial')
            elif mode == "stall-stream":
                self.wfile.write(SSE_HEAD + _chunk(EVENT))
            self.wfile.flush()
            while self.rfile.read(1):  # hold until the router closes the connection
                pass
            self.server.closed_by_router.release()
            return


@pytest.fixture(scope="module")
def engine() -> Iterator[BadEngine]:
    srv = BadEngine()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


@pytest.fixture(scope="module")
def router(stack: Stack, engine: BadEngine) -> Proc:
    url = f"http://127.0.0.1:{engine.server_address[1]}"
    cfg: dict[str, Any] = {
        "routing": {"connector": "nixl", "threshold": 100000},
        "pools": {
            "prefill": {"discovery": "static", "static": [url]},
            "decode": {"discovery": "static", "static": [url]},
        },
        "timeouts": {"firstByteSeconds": 1, "streamIdleSeconds": 1, "prefillSeconds": 1},
        "health": {"passiveFailureThreshold": 1000},
    }
    return stack.router("faults-router", write_config(stack.workdir, "faults-router", cfg))


def _errors(router: Proc, kind: str) -> float:
    return metric_value(router.url(), "pd_router_upstream_errors_total", {"kind": kind})


@pytest.mark.parametrize(
    ("mode", "status", "kind"), [("cut-body", 502, "stream"), ("stall-body", 504, "timeout")]
)
def test_non_streaming_body_failure(
    router: Proc, engine: BadEngine, mode: str, status: int, kind: str
) -> None:
    before = _errors(router, kind)
    got, body, hdrs = post_json(
        router.url() + "/v1/chat/completions", {"messages": [{"role": "user", "content": mode}]}
    )
    assert got == status, body
    assert body["error"]["message"] and body["error"]["code"] == status
    assert hdrs["x-pd-route"] == "direct"
    assert _errors(router, kind) == before + 1
    if mode.startswith("stall"):
        assert engine.closed_by_router.acquire(timeout=30)  # the engine saw the close


@pytest.mark.parametrize("mode", ["cut-stream", "stall-stream"])
def test_stream_failure_ends_with_error_event(router: Proc, engine: BadEngine, mode: str) -> None:
    before = _errors(router, "stream")
    status, hdrs, data = http_call(
        router.url() + "/v1/chat/completions",
        "POST",
        json.dumps({"messages": [{"role": "user", "content": mode}], "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = [e for e in data.split(b"\n\n") if e]
    assert events[0] == EVENT.strip()  # what the engine sent was forwarded
    err = json.loads(events[-1].removeprefix(b"data: "))
    assert err["error"]["type"] == "upstream_error"
    assert _errors(router, "stream") == before + 1
    if mode.startswith("stall"):
        assert engine.closed_by_router.acquire(timeout=30)
