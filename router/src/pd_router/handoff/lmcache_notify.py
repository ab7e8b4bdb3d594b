"""Waiting for LMCache's "KV landed" notifications, behind one interface (:class:`KvWaiter`).

Every prefill TP rank PUSHes one msgspec ``ProxyNotif(req_id)`` once its chunks reached the
decoder (LMCache 0.5.6 ``lmcache/v1/storage_backend/pd_backend.py``; a failed transfer sends
none). They go to ONE address, so with several router replicas they cannot all receive them:

- :class:`ZmqWaiter` (``lmcache.notificationReceiver: router``): this process binds the PULL
  socket and matches notifications to waiting requests; one router replica only.
  Notifications for unknown or expired request ids are dropped and counted.
- :class:`SidecarWaiter` (``prefillSidecar``): a ``pd-router notify-sidecar`` in every prefill
  pod receives them (:mod:`.lmcache_sidecar`) and the router asks the sidecar of the prefill pod
  it used, keeping no state another replica would need.

``wait`` answers ``"ok"``, ``"timeout"`` or ``"error"`` (the sidecar could not be asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol
from urllib.parse import quote

import zmq
import zmq.asyncio

from pd_router.config import LMCache
from pd_router.discovery import Endpoint
from pd_router.handoff.lmcache_wire import receive_notifications
from pd_router.metrics import Metrics
from pd_router.upstream import UpstreamClient

log = logging.getLogger("pd_router.lmcache")


class Ticket:
    """One request's expectation of notifications (``expect`` ... ``wait`` / ``cancel``)."""

    __slots__ = ("future", "remaining", "req_id")

    def __init__(self, req_id: str, future: asyncio.Future[None] | None, remaining: int) -> None:
        self.req_id = req_id
        self.future = future
        self.remaining = remaining


class KvWaiter(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def expect(self, req_id: str) -> Ticket: ...
    async def wait(self, ticket: Ticket, prefiller: Endpoint) -> str: ...
    def cancel(self, ticket: Ticket) -> None: ...


def build_waiter(lm: LMCache, up: UpstreamClient, metrics: Metrics) -> KvWaiter:
    if lm.notification_receiver == "prefillSidecar":
        return SidecarWaiter(lm, up, metrics)
    return ZmqWaiter(lm, metrics)


class ZmqWaiter:
    """ZMQ PULL socket receiving LMCache ProxyNotif messages, matched to waiting requests."""

    def __init__(self, lm: LMCache, metrics: Metrics) -> None:
        self.bind_host = lm.notify_bind_host
        self.port = lm.notify_port
        self.per_request = lm.notifications_per_request
        self.timeout = lm.notify_timeout_seconds
        self.metrics = metrics
        self.waiters: dict[str, Ticket] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100000)
        host = "*" if self.bind_host in ("0.0.0.0", "", "*") else self.bind_host
        try:
            self._sock.bind(f"tcp://{host}:{self.port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            self._sock = self._ctx = None
            msg = f"cannot bind lmcache.notifyPort on {self.bind_host}:{self.port}: {exc}"
            raise OSError(msg) from None
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())
        log.info("LMCache notification PULL socket bound on %s:%d", self.bind_host, self.port)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        unknown = self.metrics.notifications.labels("unknown")
        matched = self.metrics.notifications.labels("matched")

        def on_req_id(req_id: str) -> None:
            w = self.waiters.get(req_id)
            if w is None or w.future is None or w.future.done():
                unknown.inc()  # expired (timed out), unknown, or a duplicate: drop
                log.debug("dropped notification for unknown req_id %r", req_id)
                return
            matched.inc()
            w.remaining -= 1
            if w.remaining <= 0:
                del self.waiters[req_id]
                w.future.set_result(None)

        await receive_notifications(
            self._sock, on_req_id, self.metrics.notifications.labels("malformed")
        )

    def expect(self, req_id: str) -> Ticket:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t = self.waiters[req_id] = Ticket(req_id, fut, self.per_request)
        return t

    def cancel(self, ticket: Ticket) -> None:
        if self.waiters.get(ticket.req_id) is ticket:
            del self.waiters[ticket.req_id]
        if ticket.future is not None and not ticket.future.done():
            ticket.future.cancel()

    async def wait(self, ticket: Ticket, prefiller: Endpoint) -> str:
        """ "ok" when all notifications arrived; "timeout" otherwise (the waiter is removed,
        so later notifications for this id count as unknown)."""
        assert ticket.future is not None
        try:
            await asyncio.wait_for(asyncio.shield(ticket.future), self.timeout)
            return "ok"
        except TimeoutError:
            return "timeout"
        finally:
            self.cancel(ticket)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()


# Beyond the sidecar's own wait, what the HTTP exchange with it may take.
SIDECAR_MARGIN_SECONDS = 2.0


def sidecar_target(req_id: str, count: int, timeout: float) -> str:
    """Path and query of the sidecar's wait (pd_router.handoff.lmcache_sidecar)."""
    return f"/v1/notifications/{quote(req_id, safe='')}?count={count}&timeout={timeout!r}"


class SidecarWaiter:
    """Asks the notification sidecar of the prefill pod that served the request (over the
    router's lean HTTP client: the long poll is on the hot path of every LMCache request)."""

    def __init__(self, lm: LMCache, up: UpstreamClient, metrics: Metrics) -> None:
        self.port = lm.sidecar_port
        self.count = lm.notifications_per_request
        self.timeout = lm.notify_timeout_seconds
        self.up = up
        self.metrics = metrics
        self._outcomes = {o: metrics.sidecar_waits.labels(o) for o in ("ok", "timeout", "error")}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def expect(self, req_id: str) -> Ticket:
        return Ticket(req_id, None, self.count)  # the sidecar holds what arrives meanwhile

    def cancel(self, ticket: Ticket) -> None:
        pass  # unclaimed ids expire in the sidecar (--ttl-seconds)

    async def wait(self, ticket: Ticket, prefiller: Endpoint) -> str:
        """ "ok" (200), "timeout" (504) or "error" (anything else, including an unreachable
        sidecar); bounded by the wait plus a small margin."""
        outcome = await self._ask(prefiller.host, ticket.req_id)
        self._outcomes[outcome].inc()
        return outcome

    async def _ask(self, host: str, req_id: str) -> str:
        bound = self.timeout + SIDECAR_MARGIN_SECONDS
        target = sidecar_target(req_id, self.count, self.timeout)
        try:
            async with asyncio.timeout(bound):
                r = await self.up.get(host, self.port, False, target, b"", bound, bound)
                await r.read_release()
        except (TimeoutError, OSError) as exc:  # the lean client's UpstreamError is an OSError
            log.warning("notification sidecar %s:%d failed: %r", host, self.port, exc)
            return "error"
        if r.status == 200:
            return "ok"
        log.warning("notification sidecar %s:%d answered %d", host, self.port, r.status)
        return "timeout" if r.status == 504 else "error"
