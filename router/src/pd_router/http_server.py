"""aiohttp's server with deadlines on client connections, for the processes off the data plane
(the LMCache notification sidecar, the engine metrics proxy; the router serves on ``http1``).

aiohttp closes a connection idle for ``keepalive_timeout`` (default 3630 s) and bounds
nothing else before a first request: a client that connects and sends a request head byte by
byte, or nothing at all, holds a socket for an hour. :class:`AppRunner` passes
its idle timeout as the keep-alive timeout and gives every new connection its head
timeout to deliver its first whole request head (checked against
aiohttp 3.14's ``web_runner.py``, ``web_server.py`` and ``web_protocol.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from pd_router.serving import until_stopped, write_port_file


class _HeadDeadlineHandler(RequestHandler):
    """Closes the connection unless its first request head is parsed within the deadline."""

    __slots__ = ("_head_timeout", "_head_timer")

    def __init__(self, manager: web.Server, *, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_timer = self._loop.call_later(self._head_timeout, self._head_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # _request_count: heads parsed on this connection (a refused one counts too: it is
        # answered 400 and closed by aiohttp)
        if self._head_timer is not None and self._request_count > 0:
            self._head_timer.cancel()
            self._head_timer = None
        self._fail_open_body()

    def _fail_open_body(self) -> None:
        """A chunked body that breaks after its request was dispatched (head and body in
        separate reads, then a chunk longer than its size line): aiohttp 3.14 queues the
        parser's error as the next message and leaves the running request's body open, so
        its handler would wait timeouts.clientBodySeconds and answer 408. The body gets the
        parser's error instead, which the handler answers with a 400 at once."""
        req = self._current_request
        if req is None or not self._messages:
            return
        msg = self._messages[-1][0]
        if isinstance(msg, _ErrInfo) and not req.content.is_eof():
            req.content.set_exception(msg.exc)
            req.content.feed_eof()  # nothing more to read: aiohttp's lingering read is skipped
            self.close()  # after this answer; the queued error needs none of its own

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_late(self) -> None:
        self._head_timer = None
        self.force_close()


class _Server(web.Server):
    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = head_timeout

    def __call__(self) -> RequestHandler:
        return _HeadDeadlineHandler(
            self, loop=self._loop, head_timeout=self._head_timeout, **self._kwargs
        )


class AppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections get ``idle_timeout`` between requests and
    ``head_timeout`` for their first request head."""

    __slots__ = ("_head_timeout",)

    def __init__(
        self, app: web.Application, *, idle_timeout: float, head_timeout: float, **kwargs: Any
    ) -> None:
        super().__init__(app, keepalive_timeout=idle_timeout, **kwargs)
        self._head_timeout = head_timeout

    async def _make_server(self) -> web.Server:
        srv = await super()._make_server()  # runs the app's start-up; its kwargs are ours
        return _Server(
            srv.request_handler,
            request_factory=srv.request_factory,
            handler_cancellation=srv.handler_cancellation,
            loop=srv._loop,
            head_timeout=self._head_timeout,
            **srv._kwargs,
        )


async def serve(
    runner: AppRunner,
    host: str,
    port: int,
    backlog: int,
    port_file: str | None,
    announce: Callable[[int], None],
    reuse_port: bool = False,
) -> None:
    """Run ``runner`` on host:port until SIGTERM or SIGINT: bind, tell the starter the bound
    port (``port_file``, read by the test harness), ``announce(port)``, then clean up. The one
    serving loop of the router, the notification sidecar and the metrics proxy."""
    await runner.setup()
    try:
        # reuse_port: one of several worker processes sharing the port (pd_router.workers)
        site = web.TCPSite(
            runner, host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port or None
        )
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        write_port_file(port_file, bound)
        announce(bound)
        await until_stopped()
    finally:
        await runner.cleanup()
