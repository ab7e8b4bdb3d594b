"""A decoder that fails after its response headers (body cut short, stream cut, stream or
body stalled): the router answers in OpenAI's error format or ends the SSE stream with an
error event, closes the engine's connection, and never hangs. The decoder here is a raw
socket server in the test, misbehaving on purpose."""

from __future__ import annotations

import json
import socket
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


FLOOD_EVENTS = 256  # of 32 KiB: 8 MiB, past the client's socket and the router's buffer
# and 64 MiB: past every buffer on the way (loopback's socket buffers grow to a few MiB each)
FLOODS = {"flood": FLOOD_EVENTS, "flood-all-buffers": 2048}


def flood_event(i: int) -> bytes:
    return b"data: " + (b"%08d" % i) * 4096 + b"\n\n"


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
            if mode in FLOODS:  # more than the sockets hold, as fast as it will go
                try:
                    self.wfile.write(SSE_HEAD)
                    for i in range(FLOODS[mode]):
                        self.wfile.write(_chunk(flood_event(i)))
                    self.wfile.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:  # the router closed it: its client stopped reading
                    self.server.closed_by_router.release()
                    return
                continue
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


def _ask_flood(router: Proc, mode: str = "flood") -> socket.socket:
    """A raw client that asks for a flood stream and reads nothing yet (a small receive
    buffer: the router's writes to it back up at once)."""
    body = json.dumps({"messages": [{"role": "user", "content": mode}], "stream": True})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = router.url().removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    sock.settimeout(60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )
    return sock


def test_a_client_that_reads_slowly_gets_the_whole_stream_in_order(router: Proc) -> None:
    """The relay waits for a client that falls behind (its writes back up) and goes on once it
    reads: every byte arrives, in order."""
    sock = _ask_flood(router)
    got = bytearray()
    with sock:
        while not got.endswith(b"0\r\n\r\n"):
            part = sock.recv(4096)  # small reads: the router keeps getting ahead of this client
            assert part, "the router closed the stream early"
            got += part
    head, _, chunked = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    body = bytearray()
    while chunked:
        size, _, rest = chunked.partition(b"\r\n")
        n = int(size, 16)
        body += rest[:n]
        chunked = rest[n + 2 :]
    want = b"".join(flood_event(i) for i in range(FLOOD_EVENTS)) + b"data: [DONE]\n\n"
    assert bytes(body) == want


def test_a_client_that_stops_reading_is_dropped_and_the_engine_let_go(
    router: Proc, engine: BadEngine
) -> None:
    before = metric_value(router.url(), "pd_router_client_disconnects_total")
    with _ask_flood(router, "flood-all-buffers"):
        # reads nothing: the router gives up on it after 2 x streamIdleSeconds and closes the
        # engine's connection, which the engine's blocked write sees
        assert engine.closed_by_router.acquire(timeout=30)
    assert metric_value(router.url(), "pd_router_client_disconnects_total") == before + 1
