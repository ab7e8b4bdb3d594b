"""Lean pooled HTTP/1.1 client for the hot path (router -> engine requests).

Why not aiohttp's client here: measured on 2 cores (docs/benchmarks.md "HTTP stack"), aiohttp's
``ClientSession.post`` costs about as much CPU as the rest of a proxied request together
(cookies, redirects, tracing, URL and header objects). This client does only what an engine
call needs: keep-alive connection pool per endpoint, one ``write`` per request, response
parsing by ``httptools`` (the llhttp C parser, as used by uvicorn), Content-Length, chunked and
read-until-close bodies, interim 1xx responses skipped, streaming without copies, flow control,
and timeouts (connect, time to headers, idle gap between body chunks). A connection whose
response was not read to the end is closed, never reused, so the engine sees the disconnect and
aborts the request. A pooled connection the engine closed while idle is detected (or, when the
close races the request, the request is sent once more on a new connection); a connection that
receives bytes while idle is dropped. ``post(on_done=...)`` binds a callback (an endpoint
lease's release, ``pd_router.lease``) to the response: it runs exactly once, when the response
is released or closed, or when ``post`` itself fails. Each engine's connections waiting on it
and a count of what it sent and was sent (:meth:`UpstreamClient.waiting_on`) let
pd_router.stall find an engine that has gone silent and fail what waits on it
(:meth:`UpstreamClient.abort`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable

import httptools

_HIGH_WATER = 1 << 20
_monotonic = time.monotonic
X_PD = (0x78, 0x58)  # the first byte of an x-pd-* header name, either case


class UpstreamError(ConnectionError):
    """Connection-level failure talking to an engine."""


class EngineStalled(TimeoutError):
    """The engine went silent with calls waiting on it and did not answer its health check
    (pd_router.stall): what waited on it fails now, as a timeout would later."""


class _Conn(asyncio.Protocol):
    __slots__ = (
        "closed",
        "framed",
        "got_bytes",
        "interim",
        "parser",
        "pool",
        "resp",
        "transport",
    )

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.got_bytes = False
        self.framed = False  # the response has Content-Length or Transfer-Encoding
        self.interim = False  # parsing a 1xx interim response (skipped)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:
            # bytes nobody asked for (an idle pooled connection): never reuse it
            self.close()
            return
        self.got_bytes = True
        self.pool.heard += 1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad HTTP from engine: {exc}"))
            self.close()
        if r._pending:  # the body chunks of this read, to the sink at once (Response.sink)
            r._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.busy.discard(self)
        r = self.resp
        if r is not None and not r.complete:
            if exc is None and r.status and r.until_eof:
                r.complete = True  # a body delimited by the end of the connection
                r._wake()
            else:
                r._fail(UpstreamError("engine closed the connection"), stale=not self.got_bytes)

    def pause_writing(self) -> None:  # pragma: no cover - request bodies are small
        pass

    def resume_writing(self) -> None:  # pragma: no cover
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        # only the headers the router uses are kept (it forwards none of the others)
        n = len(name)
        if n == 12 and self.resp is not None and name.lower() == b"content-type":
            self.resp.headers["content-type"] = value.decode("latin-1")
        elif n in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True
        elif n == 11 and self.resp is not None and name.lower() == b"retry-after":
            self.resp.headers["retry-after"] = value.decode("latin-1")  # relayed by remotes
        elif name[0] in X_PD and self.resp is not None and name[:5].lower() == b"x-pd-":
            # another release's router answering (pd_router.remotes): how it served the request
            self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        framed, self.framed = self.framed, False
        code = self.parser.get_status_code()
        if code < 200:
            self.interim = True  # 100 Continue / 103 Early Hints: the real response follows
            return
        r = self.resp
        if r is None:  # a response nobody asked for (pipelined after ours): unusable
            self.close()
            return
        r.status = code
        r.keep_alive = self.parser.should_keep_alive()
        r.until_eof = not framed and code not in (204, 304)
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.resp
        if r is not None:
            r._feed(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        r = self.resp
        if r is not None:
            r.complete = True
            self.resp = None  # whatever the engine sends after this is not ours
            self.pool.busy.discard(self)  # the engine has said all it will: nothing waits on it
            r._wake()

    def _fail(self, exc: Exception) -> None:
        if self.resp is not None and not self.resp.complete:
            self.resp._fail(exc, stale=False)

    def close(self) -> None:
        self.closed = True
        self.pool.busy.discard(self)
        if self.transport is not None:
            self.transport.close()


class Response:
    """An engine response; read it with ``read()`` or ``iter_any()``, then ``release()``
    (back to the pool) or ``close()`` (drop the connection)."""

    __slots__ = (
        "_buf",
        "_buffered",
        "_conn",
        "_exc",
        "_idle",
        "_on_done",
        "_paused",
        "_pending",
        "_sink",
        "_stale",
        "_t_data",
        "_waiter",
        "complete",
        "headers",
        "keep_alive",
        "status",
        "until_eof",
    )

    def __init__(self, conn: _Conn, idle: float) -> None:
        self._conn = conn
        self._idle = idle
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.until_eof = False
        self.complete = False
        self._buf: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._exc: Exception | None = None
        self._stale = False
        self._on_done: Callable[[], None] | None = None
        self._sink: Callable[[bytes], None] | None = None  # body chunks go here as they come
        self._pending: list[bytes] = []  # the chunks of one read, for the sink
        self._t_data = 0.0  # monotonic time the sink was last given a chunk (or set)

    def _done(self) -> None:
        cb = self._on_done
        if cb is not None:
            self._on_done = None
            cb()

    # called by the protocol
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        if self._sink is not None:  # handed on once the read is parsed: no wake, no buffer
            self._pending.append(data)
            return
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _fail(self, exc: Exception, stale: bool) -> None:
        self._exc = exc
        self._stale = stale
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    async def _wait(self, timeout: float) -> None:
        if self._exc is not None:
            raise self._exc
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _timeout, w)
        try:
            await w
        finally:
            timer.cancel()
            self._waiter = None

    # ------------------------------------------------------------------ sink mode
    def sink(self, fn: Callable[[bytes], None]) -> None:
        """From now on the body is handed to ``fn`` in the connection's callback as it arrives,
        the chunks of one read as one piece (what is buffered first): a relay that keeps up
        costs no task wake-up and no timer per chunk, and writes as often as the engine's
        bytes arrive. ``fn`` must not raise; it calls :meth:`unsink` to stop (its client reads
        too slowly), and chunks are buffered again."""
        self._sink = fn
        self._t_data = _monotonic()
        if self._buf:
            fn(self._take())

    def _flush(self) -> None:
        """The chunks of one read, to the sink as one piece (one write to the client)."""
        p = self._pending
        data = p[0] if len(p) == 1 else b"".join(p)
        p.clear()
        sink = self._sink
        if sink is None:  # unsunk meanwhile: buffered for the reader
            self._buf.append(data)
            self._buffered += len(data)
            return
        self._t_data = _monotonic()
        try:
            sink(data)
        except Exception as exc:  # a bug of the relay's: its request fails, not the engine
            self._sink = None
            self._fail(exc, stale=False)
            self._conn.close()

    def unsink(self) -> None:
        """Chunks are buffered again; :meth:`sink_wait` returns."""
        self._sink = None
        self._wake()

    async def sink_wait(self) -> bool:
        """While the sink takes the chunks: True once the body is complete, False once
        :meth:`unsink` was called. Raises the connection's error, or TimeoutError when no
        chunk came for the idle timeout."""
        loop = asyncio.get_running_loop()
        while True:
            if self._exc is not None:
                raise self._exc
            if self._sink is None:
                return False
            if self.complete:
                return True
            left = self._t_data + self._idle - _monotonic()
            if left <= 0:
                raise TimeoutError()
            w = self._waiter = loop.create_future()
            timer = loop.call_later(left, _wake_up, w)  # then the idle time is checked again
            try:
                await w
            finally:
                timer.cancel()
                self._waiter = None

    async def _headers(self, timeout: float) -> None:
        while not self.status:
            await self._wait(timeout)

    def _take(self) -> bytes:
        data = b"".join(self._buf) if len(self._buf) > 1 else self._buf[0]
        self._buf.clear()
        self._buffered = 0
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def first_data(self, timeout: float, beyond: int = 0) -> None:
        """Wait (at most ``timeout``) until more than ``beyond`` body bytes arrived or the body
        ended; they stay buffered for :meth:`iter_any` (and :meth:`peek`). Raises TimeoutError
        or the connection's error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._buffered <= beyond and not self.complete:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError()
            await self._wait(remaining)

    def peek(self) -> bytes:
        """The body bytes buffered so far, left for :meth:`iter_any`."""
        return b"".join(self._buf)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (idle timeout between chunks)."""
        while True:
            if self._buf:
                yield self._take()
                continue
            if self.complete:
                return
            await self._wait(self._idle)

    async def read(self) -> bytes:
        parts = []
        async for chunk in self.iter_any():
            parts.append(chunk)
        return b"".join(parts)

    async def read_release(self) -> bytes:
        """The whole body; then the connection goes back to the pool (closed on failure)."""
        try:
            data = await self.read()
        except BaseException:
            self.close()
            raise
        self.release()
        return data

    def release(self) -> None:
        conn = self._conn
        conn.resp = None
        conn.pool.busy.discard(conn)
        if self.complete and self.keep_alive and not conn.closed and not self._buf:
            conn.pool.put(conn)
        else:
            conn.close()
        self._done()

    def close(self) -> None:
        self._conn.resp = None
        self._conn.close()
        self._done()


def _timeout(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _wake_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _HostPool:
    __slots__ = ("busy", "heard", "host", "host_header", "idle", "port", "starts", "tls")

    def __init__(self, host: str, port: int, tls: bool) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.host_header = f"{host}:{port}".encode()
        self.idle: list[_Conn] = []
        self.starts: dict[str, bytes] = {}
        self.busy: set[_Conn] = set()  # sent a request, its response not released or closed
        # requests sent and reads received: unchanged between two looks, the engine said
        # nothing (a counter, not a clock: no time call per chunk on the hot path)
        self.heard = 0

    def put(self, conn: _Conn) -> None:
        if len(self.idle) < 1024:
            self.idle.append(conn)
        else:
            conn.close()


class UpstreamClient:
    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._pools: dict[tuple[str, int, bool], _HostPool] = {}

    def _pool(self, host: str, port: int, tls: bool) -> _HostPool:
        key = (host, port, tls)
        p = self._pools.get(key)
        if p is None:
            p = self._pools[key] = _HostPool(host, port, tls)
        return p

    async def _connect(self, pool: _HostPool) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(pool), pool.host, pool.port, ssl=True if pool.tls else None
                )
        except TimeoutError:
            raise UpstreamError(f"connect to {pool.host}:{pool.port} timed out") from None
        return conn

    async def post(
        self,
        host: str,
        port: int,
        tls: bool,
        path: str,
        body: bytes,
        headers: bytes,
        first_byte_timeout: float,
        idle_timeout: float,
        on_done: Callable[[], None] | None = None,
    ) -> Response:
        """Send a POST; returns once the response headers arrived. ``headers`` is the
        pre-encoded header block (``Name: value\r\n`` lines). ``on_done`` runs once: when the
        returned response is released or closed, or now if this raises."""
        pool = self._pool(host, port, tls)
        start = pool.starts.get(path)
        if start is None:
            start = pool.starts[path] = (
                b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + pool.host_header + b"\r\n"
            )
        data = b"%sContent-Length: %d\r\n%s\r\n%s" % (start, len(body), headers, body)
        return await self._send(pool, data, first_byte_timeout, idle_timeout, on_done)

    async def get(
        self,
        host: str,
        port: int,
        tls: bool,
        target: str,
        headers: bytes,
        first_byte_timeout: float,
        idle_timeout: float,
        on_done: Callable[[], None] | None = None,
    ) -> Response:
        """Send a GET of ``target`` (path and query, already encoded); as :meth:`post`."""
        pool = self._pool(host, port, tls)
        data = b"GET %s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (
            target.encode(),
            pool.host_header,
            headers,
        )
        return await self._send(pool, data, first_byte_timeout, idle_timeout, on_done)

    async def _send(
        self,
        pool: _HostPool,
        data: bytes,
        first_byte_timeout: float,
        idle_timeout: float,
        on_done: Callable[[], None] | None,
    ) -> Response:
        try:
            for attempt in range(2):
                reused = False
                conn: _Conn | None = None
                while pool.idle:
                    c = pool.idle.pop()
                    if not c.closed:
                        conn, reused = c, True
                        break
                if conn is None:
                    conn = await self._connect(pool)
                resp = Response(conn, idle_timeout)
                conn.resp = resp
                conn.got_bytes = False
                pool.busy.add(conn)
                pool.heard += 1
                assert conn.transport is not None
                conn.transport.write(data)
                try:
                    await resp._headers(first_byte_timeout)
                except UpstreamError:
                    conn.close()
                    if reused and resp._stale and attempt == 0:
                        continue  # the engine had closed this idle connection: new one, once
                    raise
                except BaseException:
                    conn.close()
                    raise
                resp._on_done = on_done
                return resp
            raise UpstreamError("unreachable")  # pragma: no cover
        except BaseException:
            if on_done is not None:
                on_done()
            raise

    def waiting_on(self, host: str, port: int, tls: bool) -> tuple[int, int]:
        """(calls waiting on the engine, requests sent to it and reads from it so far)."""
        p = self._pools.get((host, port, tls))
        return (0, 0) if p is None else (len(p.busy), p.heard)

    def abort(self, host: str, port: int, tls: bool, exc: Exception) -> int:
        """Fail every call waiting on the engine with ``exc`` now and close its connections
        (the engine aborts them when it sees the close); returns how many."""
        p = self._pools.get((host, port, tls))
        if p is None:
            return 0
        calls = list(p.busy)
        for conn in calls:
            r, conn.resp = conn.resp, None  # its connection's loss must not speak over exc
            conn.close()
            if r is not None and not r.complete:
                r._fail(exc, stale=False)
        return len(calls)

    def close(self) -> None:
        for p in self._pools.values():
            for c in p.idle:
                c.close()
            p.idle.clear()
