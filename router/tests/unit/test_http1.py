"""The router's HTTP/1.1 server (pd_router.http1) on real loopback sockets, in-process: what it
does that the hostile-input suites (which drive the whole router process) do not reach: pipelined
requests answered in order, ``Expect: 100-continue``, a slow reader's backpressure, a client that
leaves cancelling its handler, HEAD, and the drain at SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from pd_router import http1

CHUNK = 64 * 1024


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))  # the bound only stops a broken test


@contextlib.asynccontextmanager
async def serving(routes: http1.Routes, **kw: Any) -> AsyncIterator[tuple[http1.HttpServer, int]]:
    async def not_found(req: http1.Request, allow: str | None) -> http1.Response:
        return http1.Response(status=405 if allow else 404, body=b"no")

    routes.fallback = not_found
    opts = {"max_body": 1 << 20, "max_headers": 100, "head_timeout": 30.0, "idle_timeout": 30.0}
    opts.update(kw)
    server = http1.HttpServer(routes, internal_error=lambda: http1.Response(status=500), **opts)
    port = await server.start("127.0.0.1", 0, 16)
    try:
        yield server, port
    finally:
        await server.drain(0)


async def read_answer(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lower-cased names), body (Content-Length or chunked)."""
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)}
    if status == 100:
        return status, headers, b""
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            data = await r.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += data[:-2]
    return status, headers, await r.readexactly(int(headers.get("content-length", "0")))


async def until(cond: Callable[[], bool]) -> None:
    """Poll a condition the server exposes no event for (run()'s bound stops a broken test)."""
    for _ in range(100_000):
        if cond():
            return
        await asyncio.sleep(0.01)


def echo_routes() -> http1.Routes:
    routes = http1.Routes()

    async def echo(req: http1.Request) -> http1.Response:
        body = await req.read()
        delay = float(req.headers.get("x-delay", "0"))
        if delay:  # a slow first answer: the later ones must still come after it
            await asyncio.sleep(delay)
        return http1.Response(
            body=req.path.encode() + b":" + body, headers={"x-n": req.headers.get("x-n", "")}
        )

    routes.add("POST", "/echo", echo)
    routes.add("GET", "/echo", echo)
    return routes


def request(n: int, body: bytes = b"", delay: float = 0) -> bytes:
    return (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nX-N: %d\r\nX-Delay: %g\r\nContent-Length: %d\r\n\r\n%b"
        % (n, delay, len(body), body)
    )


@pytest.mark.parametrize("count", [3, http1.MAX_PIPELINED * 3])
def test_pipelined_requests_are_answered_in_order(count: int) -> None:
    """All sent at once, the first answered slowest: each answer comes in its request's turn,
    also past MAX_PIPELINED waiting (reading pauses, then resumes)."""

    async def go() -> None:
        async with serving(echo_routes()) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"".join(request(i, b"b%d" % i, 0.05 if i == 0 else 0) for i in range(count)))
            for i in range(count):
                status, headers, body = await read_answer(r)
                assert (status, headers["x-n"], body) == (200, str(i), b"/echo:b%d" % i)
            w.close()

    run(go())


def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async def strict() -> None:
        async with serving(echo_routes()) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            assert (await read_answer(r))[0] == 100
            w.write(b"body")
            status, _, body = await read_answer(r)
            assert (status, body) == (200, b"/echo:body")
            w.close()

    run(strict())


def test_a_slow_reader_holds_the_stream_back_instead_of_being_buffered() -> None:
    """A client that stops reading: the handler's write waits once the socket's buffer passes
    WRITE_HIGH_WATER; nothing beyond that is held in the router; all of it arrives once read."""
    total = 400
    progress = {"written": 0}

    async def stream(req: http1.Request) -> http1.StreamResponse:
        out = http1.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(req)
        for _ in range(total):
            await out.write(b"x" * CHUNK)
            progress["written"] += 1
        await out.write_eof()
        return out

    async def go() -> None:
        routes = http1.Routes()
        routes.add("GET", "/stream", stream)
        async with serving(routes) as (server, port):
            r, w = await asyncio.open_connection("127.0.0.1", port, limit=CHUNK)
            w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            r._transport.pause_reading()  # type: ignore[attr-defined]  # the client stops reading
            (conn,) = server.connections

            await until(lambda: conn._drain_waiter is not None)  # the writer waits
            held = conn.transport.get_write_buffer_size()  # type: ignore[union-attr]
            assert held <= http1.WRITE_HIGH_WATER + CHUNK + 64, held
            assert progress["written"] < total  # the kernel's buffers took some, not all
            r._transport.resume_reading()  # type: ignore[attr-defined]
            status, _, body = await read_answer(r)
            assert status == 200 and len(body) == total * CHUNK
            assert progress["written"] == total
            w.close()

    run(go())


def test_a_client_that_leaves_cancels_its_handler() -> None:
    seen: dict[str, asyncio.Event] = {}

    async def forever(req: http1.Request) -> http1.Response:
        seen["started"].set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen["cancelled"].set()
            raise
        return http1.Response()

    async def go() -> None:
        routes = http1.Routes()
        routes.add("GET", "/wait", forever)
        seen.update(started=asyncio.Event(), cancelled=asyncio.Event())
        async with serving(routes) as (server, port):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            await seen["started"].wait()
            w.close()
            await seen["cancelled"].wait()
            await until(lambda: not server.connections)

    run(go())


def test_head_gets_the_headers_without_the_body_and_405_names_the_methods() -> None:
    async def go() -> None:
        async with serving(echo_routes()) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"HEAD /echo HTTP/1.1\r\n\r\nPUT /echo HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            head = await r.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 6\r\n" in head
            status, _, body = await read_answer(r)  # the next answer follows at once: no body
            assert (status, body) == (405, b"no")
            w.close()

    run(go())


def test_an_answer_before_the_whole_body_closes_the_connection() -> None:
    """The body's rest cannot be skipped safely: the answer says Connection: close and the
    connection ends after it."""

    async def early(req: http1.Request) -> http1.Response:
        return http1.Response(status=401, body=b"no key")

    async def go() -> None:
        routes = http1.Routes()
        routes.add("POST", "/early", early)
        async with serving(routes) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf")
            status, headers, body = await read_answer(r)
            assert (status, headers["connection"], body) == (401, "close", b"no key")
            assert await r.read() == b""
            w.close()

    run(go())


def test_an_early_answer_is_read_by_a_client_that_sends_its_whole_body_first() -> None:
    """An answer before the body (a 413) closes the lingering way: the server closes its side
    for writing and reads and drops the rest, so a client that writes all of a body far larger
    than the sockets buffer before it reads still gets the answer (closed at once, the
    connection was reset under the writing client: a broken pipe instead of the 413)."""
    big = 16 * 1024 * 1024

    async def early(req: http1.Request) -> http1.Response:
        return http1.Response(status=413, body=b"too large")

    async def go() -> None:
        routes = http1.Routes()
        routes.add("POST", "/early", early)
        async with serving(routes) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big)
            for _ in range(big // CHUNK):
                w.write(b"x" * CHUNK)
                await w.drain()
            status, headers, body = await read_answer(r)
            assert (status, headers["connection"], body) == (413, "close", b"too large")
            assert await r.read() == b""
            w.close()

    run(go())


def test_more_header_fields_than_max_headers_is_431() -> None:
    def head(fields: int) -> bytes:
        pad = b"".join(b"X-P%d: v\r\n" % i for i in range(fields - 2))
        return b"GET /echo HTTP/1.1\r\nHost: x\r\n%bContent-Length: 0\r\n\r\n" % pad

    async def go() -> None:
        async with serving(echo_routes(), max_headers=40) as (_, port):
            for fields, want in ((40, 200), (41, 431)):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(head(fields))
                status, _, _ = await read_answer(r)
                assert status == want, fields
                w.close()

    run(go())


def test_drain_finishes_what_is_in_flight_and_closes_the_rest() -> None:
    state: dict[str, Any] = {}

    async def slow(req: http1.Request) -> http1.Response:
        state["started"].set()
        await state["release"].wait()
        return http1.Response(body=b"done")

    async def go() -> None:
        state.update(started=asyncio.Event(), release=asyncio.Event())
        routes = echo_routes()
        routes.add("GET", "/slow", slow)
        async with serving(routes) as (server, port):
            idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
            idle_w.write(request(1))
            assert (await read_answer(idle_r))[0] == 200  # now idle, kept alive
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await state["started"].wait()
            drained = asyncio.ensure_future(server.drain(30))
            assert await idle_r.read() == b""  # the idle connection is closed at once
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)  # no longer listening
            assert not drained.done()
            state["release"].set()
            status, headers, body = await read_answer(r)
            assert (status, headers["connection"], body) == (200, "close", b"done")
            await drained
            assert not server.connections
            w.close()
            idle_w.close()

    run(go())


def test_header_values_lose_their_surrounding_whitespace() -> None:
    """RFC 9110 5.5: leading and trailing spaces and tabs are not part of a field value (llhttp
    keeps the trailing ones; the router compared "identity " with its id rule and made its own)."""

    async def go() -> None:
        async with serving(echo_routes()) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-N: \t identity \t \r\n\r\n")
            _, headers, _ = await read_answer(r)
            assert headers["x-n"] == "identity"
            w.close()

    run(go())
