"""The pooled HTTP/1.1 upstream client against real sockets and engines that misbehave on
purpose (a tiny asyncio server in the test): framing, keep-alive, stale connections, timeouts.
Every wait is bounded by ``_DEADLINE`` only so that a bug fails the test instead of hanging it;
no assertion depends on how long anything took."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pd_router.upstream import EngineStalled, UpstreamClient, UpstreamError

_DEADLINE = 30.0
Handler = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """Loopback server; ``handler(server, reader, writer, conn_no)`` plays the engine."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.eofs = 0  # connections the client closed (what makes an engine abort)
        self.eof = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(self, reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def wait_eof(self, reader: asyncio.StreamReader) -> None:
        """Hold the connection until the client closes it; count that."""
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.eofs += 1
        self.eof.set()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body, or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return await reader.readexactly(length)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def post(
    up: UpstreamClient, srv: Server, body: bytes = b"{}", first_byte: float = 10, idle: float = 10
) -> Any:
    return await up.post(
        "127.0.0.1",
        srv.port,
        False,
        "/v1/completions",
        body,
        b"Content-Type: application/json\r\n",
        first_byte,
        idle,
    )


async def fetch(up: UpstreamClient, srv: Server, body: bytes = b"{}") -> tuple[int, bytes]:
    resp = await post(up, srv, body)
    data = await resp.read()
    resp.release()
    return resp.status, data


def run(coro: Awaitable[None]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, _DEADLINE)

    asyncio.run(bounded())


def test_content_length_keep_alive_and_large_bodies() -> None:
    big_req = b"x" * (3 << 20)  # a request body far larger than one socket read

    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        while (body := await read_request(r)) is not None:
            w.write(ok(b"got %d" % len(body)))
            await w.drain()

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            assert await fetch(up, srv, b"{}") == (200, b"got 2")
            assert await fetch(up, srv, big_req) == (200, b"got %d" % len(big_req))
            assert await fetch(up, srv) == (200, b"got 2")
            assert srv.connections == 1  # kept alive and reused
            up.close()

    run(main())


def test_chunked_body_in_tiny_pieces_and_flow_control() -> None:
    payload = bytes(range(256)) * (12 << 10)  # 3 MiB: above the client's pause threshold
    written = asyncio.Event()

    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for i in range(0, len(head), 7):  # headers split across writes
            w.write(head[i : i + 7])
            await w.drain()
        pos, size = 0, 1
        while pos < len(payload):  # chunks of growing, uneven sizes
            part = payload[pos : pos + size]
            w.write(b"%x\r\n%s\r\n" % (len(part), part))
            pos += len(part)
            size = size * 3 + 1
        w.write(b"0\r\n\r\n")
        written.set()  # all of it buffered: the client reads only now (pause, resume)
        await w.drain()
        await read_request(r)

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            resp = await post(up, srv)
            assert resp.status == 200
            assert resp.headers["content-type"] == "text/event-stream"
            await written.wait()
            chunks = [c async for c in resp.iter_any()]
            assert b"".join(chunks) == payload
            assert resp.complete and resp.keep_alive
            resp.release()
            up.close()

    run(main())


def test_body_delimited_by_close_and_connection_close_header() -> None:
    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        if n == 1:  # no Content-Length, no chunking: the body ends with the connection
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await w.drain()
            return
        # Connection: close announced, but the server leaves the socket open: the client
        # must not reuse it (and closes it itself)
        w.write(ok(b"second", b"Connection: close\r\n"))
        await w.drain()
        await srv.wait_eof(r)

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            assert await fetch(up, srv) == (200, b"until the end")
            assert await fetch(up, srv) == (200, b"second")
            await srv.eof.wait()
            assert srv.eofs == 1
            up.close()

    run(main())


def test_interim_1xx_response_is_skipped() -> None:
    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        if n == 1:  # an interim response and then nothing: not an answer
            w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await w.drain()
            await srv.wait_eof(r)
            return
        while True:
            w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + ok(b"final"))
            await w.drain()
            if await read_request(r) is None:
                return

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            with pytest.raises(TimeoutError):
                await post(up, srv, first_byte=0.3)
            assert await fetch(up, srv) == (200, b"final")
            assert await fetch(up, srv) == (200, b"final")
            assert srv.connections == 2
            up.close()

    run(main())


@pytest.mark.parametrize("when", ["after_response", "on_next_request"])
def test_engine_closing_a_pooled_connection(when: str) -> None:
    """The engine drops a keep-alive connection (its idle timeout): either right after the
    response, or just as the next request arrives. The next request must succeed on a new
    connection, not fail and not hang."""

    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        w.write(ok(b"conn %d" % n))  # keep-alive by default in HTTP/1.1
        await w.drain()
        if when == "on_next_request":
            await read_request(r)  # read the next request, then close without answering

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            assert await fetch(up, srv) == (200, b"conn 1")
            assert await fetch(up, srv) == (200, b"conn 2")
            assert await fetch(up, srv) == (200, b"conn 3")
            assert srv.connections == 3
            up.close()

    run(main())


def test_bytes_on_an_idle_connection_drop_it() -> None:
    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        if n == 1:
            await read_request(r)
            # a response followed by bytes nobody asked for (a confused engine or proxy)
            w.write(ok(b"one") + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
            await w.drain()
        while await read_request(r) is not None:
            w.write(ok(b"again"))
            await w.drain()

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            assert await fetch(up, srv) == (200, b"one")
            # the stale response must never be taken for this request's answer
            assert await fetch(up, srv) == (200, b"again")
            assert srv.connections == 2
            up.close()

    run(main())


def test_first_byte_timeout_closes_the_connection() -> None:
    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        await srv.wait_eof(r)  # never answers; sees the client give up

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            with pytest.raises(TimeoutError):
                await post(up, srv, first_byte=0.2)
            await srv.eof.wait()  # the engine saw the close (and would abort)
            up.close()

    run(main())


def test_idle_gap_mid_body_times_out() -> None:
    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await srv.wait_eof(r)  # then stalls

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            resp = await post(up, srv, idle=0.2)
            got = []
            with pytest.raises(TimeoutError):
                async for chunk in resp.iter_any():
                    got.append(chunk)
            assert got == [b"first"]
            resp.close()
            await srv.eof.wait()
            up.close()

    run(main())


def test_calls_waiting_on_an_engine_are_counted_and_aborted_at_once() -> None:
    """What pd_router.stall reads and does: the calls waiting on an engine and a count of what
    went each way (sent, read), and :meth:`UpstreamClient.abort` failing them with its
    exception (not the connection's loss), one before its headers and one mid-body."""
    both_read = asyncio.Event()
    requests = 0

    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        nonlocal requests
        body = await read_request(r)
        requests += 1
        if requests == 2:
            both_read.set()
        if body == b"begin":  # a body begun, then silence
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await w.drain()
        await srv.wait_eof(r)

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            key = ("127.0.0.1", srv.port, False)
            assert up.waiting_on(*key) == (0, 0)
            headless = asyncio.ensure_future(post(up, srv, b"silent", first_byte=600))
            resp = await post(up, srv, b"begin", idle=600)
            await both_read.wait()
            reading = asyncio.ensure_future(resp.read())
            waiting, heard = up.waiting_on(*key)
            assert waiting == 2 and heard >= 3  # two sent, what came back read
            assert up.abort(*key, EngineStalled("stalled")) == 2
            with pytest.raises(EngineStalled):
                await headless
            with pytest.raises(EngineStalled):
                await reading
            resp.close()
            assert up.waiting_on(*key)[0] == 0
            while srv.eofs < 2:  # the engine saw both closes (and would abort both)
                srv.eof.clear()
                await srv.eof.wait()
            assert up.abort(*key, EngineStalled("again")) == 0  # negative control: none left
            up.close()

    run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",  # closed mid-body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # no last chunk
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
    ],
)
def test_broken_responses_fail_cleanly(reply: bytes) -> None:
    async def handler(
        srv: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(r)
        w.write(reply)
        await w.drain()

    async def main() -> None:
        async with Server(handler) as srv:
            up = UpstreamClient(5)
            with pytest.raises(UpstreamError):
                resp = await post(up, srv)
                await resp.read()
            up.close()

    run(main())


def test_connect_refused_and_connect_timeout() -> None:
    async def main() -> None:
        up = UpstreamClient(0.3)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, not listening: refused
            with pytest.raises(OSError):
                await up.post("127.0.0.1", port, False, "/x", b"", b"", 5, 5)
        # a listener whose accept queue is full drops new SYNs: the connect never completes
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(0)
        port = ls.getsockname()[1]
        held = []
        try:
            for _ in range(16):
                try:
                    async with asyncio.timeout(0.5):
                        held.append(await asyncio.open_connection("127.0.0.1", port))
                except TimeoutError:
                    break
            else:
                pytest.skip("could not fill the listen queue here")
            with pytest.raises(UpstreamError, match="timed out"):
                await up.post("127.0.0.1", port, False, "/x", b"", b"", 5, 5)
        finally:
            for _, w in held:
                w.close()
            ls.close()
        up.close()

    run(main())
