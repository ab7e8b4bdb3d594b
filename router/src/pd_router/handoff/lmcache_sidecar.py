"""LMCache notification sidecar (``pd-router notify-sidecar``), one per prefill pod.

The prefiller's LMCache sender PUSHes one msgspec ``ProxyNotif(req_id)`` per TP rank to its
``pd_proxy_host:pd_proxy_port``; with ``pd_proxy_host: 127.0.0.1`` that is this process's ZMQ
PULL socket (``--zmq-bind``). Notifications are counted per ``req_id`` and kept for
``--ttl-seconds`` (at most ``--max-pending`` ids; the least recently touched are dropped and
counted), so one that arrives before the router asks is not lost. A router (any replica)
that sent a prefill request to this pod asks::

    GET /v1/notifications/{req_id}?count=N&timeout=S

200 ``{"req_id", "received"}`` as soon as N notifications for ``req_id`` arrived (the entry
is then removed), 504 (OpenAI error JSON) when S seconds pass first, 400 for a bad
``count`` (1..64, default 1) or ``timeout`` (0 < S <= 600, default 30). Also ``GET /health``
and ``GET /metrics``. The router keeps no state another replica would need.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from dataclasses import dataclass

import orjson
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pd_router.config import NOTIFY_PORT, SIDECAR_MAX_COUNT, SIDECAR_MAX_TIMEOUT, SIDECAR_PORT
from pd_router.handoff.lmcache_wire import receive_notifications
from pd_router.http_server import AppRunner, serve

HEAD_TIMEOUT_SECONDS = 5.0  # a client's first request head, whole
IDLE_TIMEOUT_SECONDS = 60.0  # keep-alive between the router's waits

log = logging.getLogger("pd_router.handoff.lmcache_sidecar")


@dataclass
class SidecarOptions:
    host: str = "0.0.0.0"
    port: int = SIDECAR_PORT
    zmq_bind: str = f"tcp://127.0.0.1:{NOTIFY_PORT}"
    ttl_seconds: float = 120.0
    max_pending: int = 100000


class _Entry:
    __slots__ = ("count", "touched", "waiters")

    def __init__(self, now: float) -> None:
        self.count = 0
        self.touched = now
        self.waiters: list[tuple[int, asyncio.Future[int]]] = []


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.notifications = Counter(
            "pd_notify_sidecar_notifications",
            "LMCache ProxyNotif messages received (received|malformed)",
            ["result"],
            registry=r,
        )
        self.waits = Counter(
            "pd_notify_sidecar_waits",
            "Wait requests by outcome (ok|timeout|bad_request|cancelled)",
            ["outcome"],
            registry=r,
        )
        self.pending = Gauge(
            "pd_notify_sidecar_pending_entries",
            "Request ids held (buffered or waited on)",
            registry=r,
        )
        self.dropped = Counter(
            "pd_notify_sidecar_dropped_entries",
            "Request ids dropped unclaimed (overflow: over --max-pending; expired: ttl)",
            ["reason"],
            registry=r,
        )

        for outcome in ("ok", "timeout", "bad_request", "cancelled"):
            self.waits.labels(outcome)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _error(status: int, message: str, etype: str) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class NotificationStore:
    """Per-req_id notification counts with waiters; least recently touched first."""

    def __init__(self, ttl: float, max_pending: int, metrics: SidecarMetrics) -> None:
        self.ttl = ttl
        self.max_pending = max_pending
        self.metrics = metrics
        self.entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._received = metrics.notifications.labels("received")
        self._expired = metrics.dropped.labels("expired")
        self._overflow = metrics.dropped.labels("overflow")

    def _touch(self, req_id: str, now: float, trim: bool = True) -> _Entry:
        e = self.entries.get(req_id)
        if e is None:
            e = self.entries[req_id] = _Entry(now)
            if trim:  # a waiter's new entry drops no buffered notification (waits are bounded)
                self._trim(req_id)
        else:
            e.touched = now
            self.entries.move_to_end(req_id)
        return e

    def _trim(self, keep: str) -> None:
        """Drop the least recently touched ids beyond max_pending (never one being waited on:
        it is moved to the back instead; waits are bounded, so it leaves soon)."""
        budget = len(self.entries)
        while len(self.entries) > self.max_pending and budget > 0:
            budget -= 1
            req_id, e = next(iter(self.entries.items()))
            if e.waiters or req_id == keep:
                self.entries.move_to_end(req_id)
                continue
            del self.entries[req_id]
            self._overflow.inc()
        self.metrics.pending.set(len(self.entries))

    def expire(self, now: float) -> None:
        budget = len(self.entries)
        while self.entries and budget > 0:
            budget -= 1
            req_id, e = next(iter(self.entries.items()))
            if now - e.touched < self.ttl:
                break
            if e.waiters:
                e.touched = now
                self.entries.move_to_end(req_id)
                continue
            del self.entries[req_id]
            self._expired.inc()
        self.metrics.pending.set(len(self.entries))

    def notify(self, req_id: str) -> None:
        self._received.inc()
        now = time.monotonic()
        self.expire(now)
        e = self._touch(req_id, now)
        e.count += 1
        self._wake(req_id, e)

    def _wake(self, req_id: str, e: _Entry) -> None:
        done = False
        for need, fut in e.waiters:
            if e.count >= need and not fut.done():
                fut.set_result(e.count)
                done = True
        if done:
            e.waiters = [(n, f) for n, f in e.waiters if not f.done()]
            if not e.waiters:
                self.entries.pop(req_id, None)
                self.metrics.pending.set(len(self.entries))

    async def wait(self, req_id: str, count: int, timeout: float) -> int | None:
        """The number received once ``count`` arrived (entry removed), None on timeout."""
        e = self._touch(req_id, time.monotonic(), trim=False)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        item = (count, fut)
        e.waiters.append(item)
        self._wake(req_id, e)  # those that arrived before the call count too
        self.metrics.pending.set(len(self.entries))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return fut.result() if fut.done() else None
        finally:
            if item in e.waiters:
                e.waiters.remove(item)
            if not fut.done():
                fut.cancel()
            # an id nothing arrived for is not kept once nobody waits for it
            if not e.waiters and e.count == 0 and self.entries.get(req_id) is e:
                del self.entries[req_id]
            self.metrics.pending.set(len(self.entries))


class NotifySidecar:
    def __init__(self, opts: SidecarOptions) -> None:
        self.opts = opts
        self.metrics = SidecarMetrics()
        self.store = NotificationStore(opts.ttl_seconds, opts.max_pending, self.metrics)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.zmq_endpoint = ""

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100000)
        try:
            self._sock.bind(self.opts.zmq_bind)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            self._sock = None
            self._ctx = None
            raise OSError(f"cannot bind --zmq-bind {self.opts.zmq_bind}: {exc}") from None
        self.zmq_endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._recv_loop()))
        self._tasks.append(loop.create_task(self._expire_loop()))

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        await receive_notifications(
            self._sock, self.store.notify, self.metrics.notifications.labels("malformed")
        )

    async def _expire_loop(self) -> None:
        period = min(max(self.opts.ttl_seconds / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            self.store.expire(time.monotonic())

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()

    # ------------------------------------------------------------------ HTTP
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def wait_handler(self, request: web.Request) -> web.Response:
        req_id = request.match_info["req_id"]
        q = request.query
        try:
            count = int(q.get("count", "1"))
            timeout = float(q.get("timeout", "30"))
        except ValueError:
            count, timeout = 0, 0.0
        if not 1 <= count <= SIDECAR_MAX_COUNT or not (
            math.isfinite(timeout) and 0 < timeout <= SIDECAR_MAX_TIMEOUT
        ):
            self.metrics.waits.labels("bad_request").inc()
            return _error(
                400,
                f"count must be an integer 1..{SIDECAR_MAX_COUNT} and timeout a number of "
                f"seconds in (0, {SIDECAR_MAX_TIMEOUT:g}]",
                "invalid_request_error",
            )
        try:
            got = await self.store.wait(req_id, count, timeout)
        except asyncio.CancelledError:
            self.metrics.waits.labels("cancelled").inc()
            raise
        if got is None:
            self.metrics.waits.labels("timeout").inc()
            return _error(
                504,
                f"{count} notification(s) for {req_id!r} did not arrive within {timeout:g} s",
                "timeout_error",
            )
        self.metrics.waits.labels("ok").inc()
        return web.Response(
            body=orjson.dumps({"req_id": req_id, "received": got}),
            content_type="application/json",
        )

    async def not_found(self, request: web.Request) -> web.Response:
        return _error(404, f"no route for {request.path}", "not_found_error")


def build_sidecar_app(sidecar: NotifySidecar) -> web.Application:
    app = web.Application(client_max_size=1024)
    app.router.add_get("/health", sidecar.health)
    app.router.add_get("/metrics", sidecar.metrics_handler)
    # ".+": request ids may contain "/" (X-Request-Id allows it); the router percent-encodes
    app.router.add_get("/v1/notifications/{req_id:.+}", sidecar.wait_handler)
    app.router.add_route("*", "/{tail:.*}", sidecar.not_found)

    async def on_startup(_: web.Application) -> None:
        await sidecar.start()

    async def on_cleanup(_: web.Application) -> None:
        await sidecar.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def run_sidecar(opts: SidecarOptions, port_file: str | None = None) -> None:
    sidecar = NotifySidecar(opts)
    app = build_sidecar_app(sidecar)
    # The router's hardened server: a slow or silent connection cannot hold a socket (the
    # router's long-poll wait is one request, which the keep-alive timeout does not cut).
    runner = AppRunner(
        app,
        idle_timeout=IDLE_TIMEOUT_SECONDS,
        head_timeout=HEAD_TIMEOUT_SECONDS,
        handler_cancellation=True,
        access_log=None,
    )

    def announce(port: int) -> None:
        log.warning(
            "notify-sidecar listening on %s:%d, ZMQ PULL on %s",
            opts.host,
            port,
            sidecar.zmq_endpoint,
        )

    await serve(runner, opts.host, opts.port, 1024, port_file, announce)
