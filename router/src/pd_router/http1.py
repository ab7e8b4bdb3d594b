"""The router's HTTP/1.1 server: asyncio Protocols (on uvloop) around httptools' parser (llhttp,
the parser family aiohttp's C parser and uvicorn use), with nothing per request that the router
does not read.

Why not aiohttp's server: a request cost twice the CPU there (issue 24: the same handler on a
Protocol server took 0.45-0.77x of aiohttp's server CPU per request). What it keeps of aiohttp's
rules, on which the hostile-input suites hold the router (checked against aiohttp 3.14.5's
``http_parser.py``, ``web_protocol.py``):

* a request line, a header name and a header value are at most ``MAX_FIELD`` (8190) bytes, the
  whole head ``MAX_HEAD`` bytes; a second value of a ``SINGLETON_HEADERS`` header, a malformed
  line, an invalid method or URL byte (llhttp, strict) is a plain-text 400 and the connection
  closes; more header fields than ``limits.maxHeaders`` (pd_router.config.MAX_HEADERS by
  default, Envoy's; aiohttp allowed 128) is a plain-text 431; ``OPTIONS *`` and ``CONNECT``
  are a plain-text 404 (no route can match them);
* a new connection gets ``head_timeout`` (or ``idle_timeout`` if shorter) for its first whole
  request head, a keep-alive one ``idle_timeout`` between requests; neither runs while a
  request is read or answered (the body has its own deadline, the app's
  ``timeouts.clientBodySeconds``);
* ``Expect: 100-continue`` is answered 100 when the handler starts, before it reads the body;
* pipelined requests are answered in order, one at a time; after ``MAX_PIPELINED`` waiting the
  connection stops reading until one is answered;
* a body error after the request was dispatched (a broken chunk) goes to that request's body,
  which the app answers 400 (JSON); the connection then closes;
* a streamed answer is chunked (HTTP/1.1) and its writer waits while the socket's buffer is
  over ``WRITE_HIGH_WATER``: a slow reader never makes the router buffer a whole stream;
* a client that goes away cancels its handler (the upstream legs close with it);
* an answer sent before the request was read to its end (a 413 for a body over the limit, a
  refusal of the head) closes the connection the lingering way: the router's side closes for
  writing and what the client still sends is read and dropped, for up to ``LINGER_SECONDS``
  (``LINGER_IDLE_SECONDS`` without a byte), so that the client, which writes its whole body
  before it reads, gets to read the answer: a socket closed with bytes unread is reset, and
  the client then sees a broken pipe instead of the 413 (nginx's lingering close and its
  defaults, ``lingering_time`` and ``lingering_timeout``);
* SIGTERM: stop listening, close idle connections, let in-flight requests finish for up to
  ``DRAIN_SECONDS`` (aiohttp's ``shutdown_timeout`` default), then close the rest.

Refusals are logged as one warning line each (``pd_router.logs`` rate-limits them), naming
llhttp's reason, never quoting the request bytes (they may hold a key or a prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools

from pd_router.serving import until_stopped, write_port_file

# The logger of the server's refusals (pd_router.logs rate-limits it and keeps its lines short).
log = logging.getLogger("pd_router.http")

MAX_FIELD = 8190  # aiohttp's max_line_size and max_field_size
MAX_HEAD = 65536  # a whole request head (aiohttp bounds header count * field size instead)
MAX_PIPELINED = 8  # requests parsed ahead of the one being answered before reading pauses
LINGER_SECONDS = 30.0  # nginx's lingering_time (1.28)
LINGER_IDLE_SECONDS = 5.0  # nginx's lingering_timeout
WRITE_HIGH_WATER = 64 * 1024  # a stream's writer waits above this many unsent bytes
DRAIN_SECONDS = 60.0
# A second value of one of these is refused (aiohttp 3.14.5 http_parser.SINGLETON_HEADERS).
SINGLETON_HEADERS = frozenset(
    {
        "content-length",
        "content-location",
        "content-range",
        "content-type",
        "etag",
        "host",
        "max-forwards",
        "server",
        "transfer-encoding",
        "user-agent",
    }
)
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class BodyError(Exception):
    """The request body could not be read: its framing broke (``message`` is llhttp's reason, no
    byte of the body in it) or it outgrew ``max_body``."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.too_large = too_large


class Headers:
    """A request's headers: the first value of each name, names lower-cased, values decoded as
    UTF-8 with surrogateescape (as aiohttp does)."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[str, str]) -> None:
        self._d = d

    def get(self, name: str, default: Any = None) -> Any:
        """``name`` in lower case (the router's own names are: no case folding per call)."""
        return self._d.get(name, default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._d

    def items(self) -> Iterable[tuple[str, str]]:
        return self._d.items()


class Request:
    """One parsed request. ``match_info`` holds the route's path parameters."""

    __slots__ = (
        "_body",
        "_conn",
        "_continue",
        "_done",
        "_error",
        "_size",
        "_waiter",
        "content_length",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query",
        "remote",
        "version",
    )

    def __init__(
        self, conn: HttpConnection, method: str, target: bytes, headers: dict[str, str]
    ) -> None:
        self._conn = conn
        self.method = method
        self.path, self.query = _split_target(target)
        self.headers = Headers(headers)
        self.version = "1.1"
        self.keep_alive = True
        cl = headers.get("content-length")
        self.content_length = int(cl) if cl is not None else None  # llhttp checked it
        self.match_info: dict[str, str] = {}
        self.remote = conn.peer
        self._body: list[bytes] = []
        self._size = 0
        self._done = False
        self._error: BodyError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._continue = headers.get("expect", "").lower() == "100-continue"

    @property
    def body_complete(self) -> bool:
        """Whether the whole body arrived (most bodies come with the head)."""
        return self._done or self._error is not None

    async def read(self) -> bytes:
        """The whole body; :class:`BodyError` if its framing broke or it outgrew the limit."""
        if not self.body_complete:
            if self._continue:
                self._continue = False
                self._conn.send_continue()
            self._waiter = asyncio.get_running_loop().create_future()
            self._conn.want_body()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        body = self._body
        if len(body) == 1:
            return body[0]
        return b"".join(body)

    # fed by the connection
    def _feed(self, data: bytes, limit: int) -> None:
        if self._error is not None:
            return
        self._size += len(data)
        if self._size > limit:
            self._body.clear()
            self._fail(BodyError("request body too large", too_large=True))
            return
        self._body.append(data)

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, err: BodyError) -> None:
        if self._error is None and not self._done:
            self._error = err
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Response:
    """A whole answer (``body`` with its Content-Length)."""

    __slots__ = ("body", "headers", "status")
    prepared = False

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        content_type: str | None = None,
        headers: Any = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers: dict[str, str] = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type


class StreamResponse:
    """An answer sent as it is made: ``prepare`` sends the head, ``write`` each piece (waiting
    while the client reads slower than it is written), ``write_eof`` the end."""

    __slots__ = ("_chunked", "_conn", "_ended", "headers", "prepared", "status")

    def __init__(self, *, status: int = 200, headers: Any = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self.prepared = False
        self._conn: HttpConnection | None = None
        self._chunked = True
        self._ended = False

    async def prepare(self, request: Request) -> None:
        conn = self._conn = request._conn
        self._chunked = request.version != "1.0"
        if not self._chunked:
            conn.closing = True  # an HTTP/1.0 stream ends with the connection
        conn.write_head(self.status, self.headers, None if not self._chunked else -1, request)
        self.prepared = True
        await conn.drain()

    async def write(self, data: bytes) -> None:
        if self.write_now(data):  # most writes go straight out: no wait to set up
            await self.drain()

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` without waiting; True when the client reads slower than it is written
        (its transport's buffer is over the high-water mark): :meth:`drain` before more."""
        conn = self._conn
        if conn is None or self._ended:
            raise RuntimeError("write on a stream that is not open")
        if data:
            conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return conn._write_paused

    async def drain(self) -> None:
        """Until the client has read what was written (at once when it keeps up)."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("drain on a stream that is not open")
        await conn.drain()

    async def write_eof(self) -> None:
        conn = self._conn
        if conn is None or self._ended:
            return
        self._ended = True
        if self._chunked:
            conn.write(b"0\r\n\r\n")
        await conn.drain()


Answer = Response | StreamResponse  # what a handler returns
Handler = Callable[[Request], Awaitable[Answer]]


class Routes:
    """Exact paths and path prefixes to handlers, by method; what matches no route is 405 (with
    ``Allow``) when the path has one under another method, else the ``fallback``'s answer."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._prefix: list[tuple[str, str, dict[str, Handler]]] = []  # (prefix, param, methods)
        self.fallback: Callable[[Request, str | None], Awaitable[Any]] | None = None

    def add(self, method: str, path: str, handler: Handler) -> None:
        methods = self._exact.setdefault(path, {})
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def add_prefix(self, method: str, prefix: str, param: str, handler: Handler) -> None:
        """``prefix`` followed by at least one character, which goes to ``match_info[param]``."""
        methods = next((m for p, _, m in self._prefix if p == prefix), None)
        if methods is None:
            methods = {}
            self._prefix.append((prefix, param, methods))
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def resolve(self, request: Request) -> tuple[Handler | None, str | None]:
        """The handler, or None and the ``Allow`` value (None: no route has this path)."""
        path = request.path
        methods = self._exact.get(path)
        if methods is None:
            for prefix, param, m in self._prefix:
                if len(path) > len(prefix) and path.startswith(prefix):
                    request.match_info[param] = path[len(prefix) :]
                    methods = m
                    break
            else:
                return None, None
        handler = methods.get(request.method)
        if handler is not None:
            return handler, None
        return None, ", ".join(sorted(methods))


def _split_target(target: bytes) -> tuple[str, str]:
    """A request target's percent-decoded path and its raw query (origin or absolute form; a
    fragment, which a client should not send, is dropped as aiohttp does). Not normalized:
    ``/v1/../x`` stays what it is and matches no route."""
    if target[:1] != b"/":  # absolute form (the connection refused any other)
        rest = target.split(b"//", 1)[1]
        slash = rest.find(b"/")
        target = rest[slash:] if slash >= 0 else b"/"
    target = target.split(b"#", 1)[0]
    path, _, query = target.partition(b"?")
    text = path.decode("latin-1")
    if "%" in text:
        text = unquote(text, errors="replace")  # not UTF-8: no route has it
    return text, query.decode("latin-1")


class _Clock:
    """The Date header, made once a second (formatdate costs more than the rest of a head)."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


_clock = _Clock()


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests, runs each one's handler in turn, writes the
    answers in order."""

    __slots__ = (
        "_current",
        "_drain_waiter",
        "_head_size",
        "_header_count",
        "_headers",
        "_linger_until",
        "_parse_failed",
        "_paused_reading",
        "_queue",
        "_task",
        "_timer",
        "_url",
        "_write_paused",
        "closing",
        "loop",
        "parser",
        "peer",
        "server",
        "transport",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = ""
        self.closing = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_size = 0
        self._current: Request | None = None  # the request being parsed
        self._queue: deque[Request] = deque()  # parsed, waiting for their turn (the first runs)
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused_reading = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._parse_failed = False
        self._header_count = 0
        self._linger_until = 0.0  # lingering (see the module docstring) until then; 0: not

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else str(peer or "")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        # nothing sent yet is idle too (aiohttp's keep-alive timer runs from the start)
        self._arm(min(self.server.head_timeout, self.server.idle_timeout))

    def data_received(self, data: bytes) -> None:
        if self._parse_failed:
            if self._linger_until:  # dropped; the wait for the next bytes starts again
                self._arm(min(LINGER_IDLE_SECONDS, self._linger_until - self.loop.time()))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade_refused()
        except httptools.HttpParserError as exc:
            why = exc.__context__  # a callback's own refusal, wrapped by httptools
            if isinstance(why, _Refused):
                self._refuse(why.status, why.reason, why.logged)
            else:
                self._parse_error(str(exc).split("\n", 1)[0])

    def connection_lost(self, exc: BaseException | None) -> None:
        self.server.connections.discard(self)
        self._disarm()
        self.closing = True
        if self._current is not None:
            self._current._fail(BodyError("the client closed the connection"))
        for req in self._queue:
            req._fail(BodyError("the client closed the connection"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client is gone: so are its legs upstream
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._head_size = 0
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_FIELD:
            raise _Refused(400, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_FIELD or len(value) > MAX_FIELD:
            raise _Refused(400, "header line too long")
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise _Refused(400, "request head too large")
        self._header_count += 1
        if self._header_count > self.server.max_headers:
            raise _Refused(431, "too many header fields")
        key = name.decode("latin-1").lower()
        if key in self._headers:
            if key in SINGLETON_HEADERS:
                raise _Refused(400, "duplicate singleton header")
            return  # the first value is the one the router reads
        # A field value excludes its surrounding whitespace (RFC 9110 5.5); llhttp (httptools 0.9.0)
        # drops the leading but keeps the trailing, so " identity " arrived as "identity ".
        self._headers[key] = value.rstrip(b" \t").decode("utf-8", "surrogateescape")

    def on_headers_complete(self) -> None:
        p = self.parser
        if self._url[:1] != b"/" and not self._url.startswith((b"http://", b"https://")):
            raise _Refused(404, "no route", logged=False)  # "*" (OPTIONS): no route matches it
        req = Request(self, p.get_method().decode("latin-1"), self._url, self._headers)
        req.version = p.get_http_version()
        req.keep_alive = p.should_keep_alive()
        self._disarm()  # a whole head arrived: the head and idle deadlines stop
        self._current = req
        self._queue.append(req)
        if len(self._queue) == 1:
            self._task = self.loop.create_task(self._serve(req))
        elif len(self._queue) > MAX_PIPELINED:
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        req = self._current
        if req is not None:
            req._feed(body, self.server.max_body)
            if req._error is not None and req._error.too_large:
                self.closing = True  # the rest of the body is not read: nothing can follow

    def on_message_complete(self) -> None:
        req = self._current
        self._current = None
        if req is not None:
            req._end()

    # ------------------------------------------------------------------ serving
    async def _serve(self, req: Request) -> None:
        while True:
            keep = await self._answer(req)
            queue = self._queue
            if queue and queue[0] is req:
                queue.popleft()
            if not keep or self.closing or self.transport is None or self.transport.is_closing():
                if not req.body_complete or req._error is not None or isinstance(req, _Refusal):
                    self._linger()  # answered before the client was done sending (a 413)
                else:
                    self._close()
                return
            if self._paused_reading and len(queue) <= MAX_PIPELINED:
                self._resume_reading()
            if not queue:
                self._task = None
                if self.server.draining:
                    self._close()
                else:
                    self._arm(self.server.idle_timeout)
                return
            req = queue[0]

    async def _answer(self, req: Request) -> bool:
        """Run the handler and send its answer; whether the connection may carry another."""
        if isinstance(req, _Refusal):  # the bytes after the pipelined requests were refused
            with contextlib.suppress(ConnectionError):
                self.write(req.data)
            return False
        try:
            resp = await self.server.dispatch(req)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: the app answers its own errors
            log.exception("unhandled error serving %s %s", req.method, req.path[:200])
            resp = self.server.internal_error()
        if self.transport is None or self.transport.is_closing():
            return False
        keep = req.keep_alive and not self.closing and not self.server.draining
        if not req.body_complete:
            keep = False  # an unread body cannot be skipped safely: this answer is the last
        if req._error is not None:
            keep = False  # after a broken body the parser cannot find the next request
        if isinstance(resp, StreamResponse):
            if not resp.prepared:
                resp.headers.setdefault("Content-Length", "0")
                self.write_head(resp.status, resp.headers, 0, req, keep)
            elif not resp._ended:
                keep = False  # a stream left open: only closing ends it for the client
            return keep and resp._chunked
        body = resp.body if req.method != "HEAD" else b""
        self.write_head(resp.status, resp.headers, len(resp.body), req, keep, body)
        return keep

    def write_head(
        self,
        status: int,
        headers: dict[str, str],
        length: int | None,
        req: Request,
        keep: bool = True,
        body: bytes = b"",
    ) -> None:
        """Status line and headers; ``length`` -1 for chunked, None for until-close."""
        parts = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown"))]
        for name, value in headers.items():
            parts.append(b"%b: %b\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        if length == -1:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        elif length is not None:
            parts.append(b"Content-Length: %d\r\n" % length)
        parts.append(b"Date: %b\r\n" % _clock.date())
        if not keep or length is None or self.server.draining:
            parts.append(b"Connection: close\r\n")
        elif req.version == "1.0":
            parts.append(b"Connection: keep-alive\r\n")
        parts.append(b"\r\n")
        parts.append(body)
        self.write(b"".join(parts))

    def write(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        t.write(data)

    async def drain(self) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if not self._write_paused:
            return
        self._drain_waiter = self.loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def send_continue(self) -> None:
        with contextlib.suppress(ConnectionError):
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def want_body(self) -> None:
        """A handler waits for its body: reading must go on even with a full pipeline."""
        if self._paused_reading:
            self._resume_reading()

    # ------------------------------------------------------------------ refusals and closing
    def _parse_error(self, reason: str) -> None:
        self._parse_failed = True
        req = self._current
        if req is not None:  # dispatched already: its body gets the error, the app answers 400
            self._current = None
            req._fail(BodyError(reason))
            self.closing = True
            if self._task is None:
                self._close()
            return
        self._refuse(400, reason)

    def _upgrade_refused(self) -> None:
        """CONNECT (or an Upgrade llhttp stops at): no route serves it."""
        self._parse_failed = True
        self._refuse(404, "no route", logged=False)

    def _refuse(self, status: int, reason: str, logged: bool = True) -> None:
        """A plain-text answer to bytes the router never dispatched, then close (after the
        answers to requests parsed before them)."""
        self._parse_failed = True
        self._current = None
        if logged:
            self.server.log_refusal(self.peer, status, reason)
        phrase = _REASONS.get(status, b"Bad Request")
        body = b"%d: %b" % (status, phrase)
        data = (
            b"HTTP/1.1 %d %b\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\nDate: %b\r\nConnection: close\r\n\r\n%b"
            % (status, phrase, len(body), _clock.date(), body)
        )
        if self._task is None:
            with contextlib.suppress(ConnectionError):
                self.write(data)
            self._linger()
        else:  # after the answers already on their way: a sentinel request
            self._queue.append(_Refusal(self, data))  # type: ignore[arg-type]

    def _pause_reading(self) -> None:
        if not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._paused_reading and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._close)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _linger(self) -> None:
        """Close after an answer sent before the request was read to its end (see the module
        docstring): our side closes for writing; what comes in is dropped until the client
        closes, ``LINGER_IDLE_SECONDS`` pass without a byte or ``LINGER_SECONDS`` in all."""
        t = self.transport
        if t is None or t.is_closing() or not t.can_write_eof() or self.server.draining:
            self._close()
            return
        self.closing = True
        self._parse_failed = True  # nothing read from now on is parsed
        self._current = None
        with contextlib.suppress(OSError):
            t.write_eof()
        self._linger_until = self.loop.time() + LINGER_SECONDS
        self._resume_reading()
        self._arm(LINGER_IDLE_SECONDS)

    def _close(self) -> None:
        self.closing = True
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close_if_idle(self) -> None:
        """Draining: a connection between requests closes now, one mid-request after it."""
        if self._task is None:
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class _Refused(Exception):
    """Raised in a parser callback: answer ``status`` in plain text and close."""

    def __init__(self, status: int, reason: str, logged: bool = True) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.logged = logged


class _Refusal:
    """In the answer queue after pipelined requests: the refusal's bytes, sent in their turn."""

    def __init__(self, conn: HttpConnection, data: bytes) -> None:
        self.data = data
        self.keep_alive = False
        self._error = None
        self.body_complete = True
        self.method = "REFUSED"
        self.path = ""


class HttpServer:
    """Owns the listening socket and the connections; ``dispatch`` is the app's entry."""

    def __init__(
        self,
        routes: Routes,
        *,
        max_body: int,
        max_headers: int,
        head_timeout: float,
        idle_timeout: float,
        internal_error: Callable[[], Response],
    ) -> None:
        self.routes = routes
        self.max_body = max_body
        self.max_headers = max_headers
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.internal_error = internal_error
        self.connections: set[HttpConnection] = set()
        self.draining = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start
        self._server: asyncio.AbstractServer | None = None

    async def dispatch(self, req: Request) -> Answer:
        handler, allow = self.routes.resolve(req)
        if handler is not None:
            return await handler(req)
        assert self.routes.fallback is not None
        return await self.routes.fallback(req, allow)

    def log_refusal(self, peer: str, status: int, reason: str) -> None:
        log.warning(  # one line: pd_router.logs rate-limits it per template
            "refused a malformed HTTP request from %s: %d %s", peer, status, reason
        )

    async def start(self, host: str, port: int, backlog: int, reuse_port: bool = False) -> int:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: HttpConnection(self),
            host,
            port,
            backlog=backlog,
            reuse_address=True,
            reuse_port=reuse_port or None,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def drain(self, seconds: float = DRAIN_SECONDS) -> None:
        """Stop accepting, close idle connections, give in-flight requests ``seconds``."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        end = self.loop.time() + seconds
        while self.connections and self.loop.time() < end:
            busy = [c._task for c in self.connections if c._task is not None and not c._task.done()]
            if not busy:
                break
            await asyncio.wait(busy, timeout=max(0.0, end - self.loop.time()))
        for conn in list(self.connections):
            conn.abort()


async def serve(
    server: HttpServer,
    host: str,
    port: int,
    backlog: int,
    port_file: str | None,
    announce: Callable[[int], None],
    on_startup: Callable[[], Awaitable[None]],
    on_cleanup: Callable[[], Awaitable[None]],
    reuse_port: bool = False,
) -> None:
    """Start the app, listen, tell the starter the port, serve until SIGTERM/SIGINT, drain,
    stop the app."""
    await on_startup()
    try:
        bound = await server.start(host, port, backlog, reuse_port)
        write_port_file(port_file, bound)
        announce(bound)
        await until_stopped()
        await server.drain()
    finally:
        await on_cleanup()
