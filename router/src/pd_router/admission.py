"""Admission: at most ``limits.maxInFlight`` requests are served at once, up to
``limits.maxQueued`` more wait (each at most ``limits.queueTimeoutSeconds``) in arrival order,
and the rest are refused at once. A slot is handed from a finishing request straight to the
oldest waiter, so a burst cannot overtake the queue."""

from __future__ import annotations

import asyncio
import collections

from pd_router.config import Limits
from pd_router.metrics import Metrics


class Reject(Exception):
    """Refused admission: what the client is told (429 queue full, 503 queue wait timed out)."""

    def __init__(self, status: int, message: str, etype: str, retry_after: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.retry_after = retry_after


class Admission:
    def __init__(self, limits: Limits, metrics: Metrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.in_flight = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        """Take a slot (waiting in line if need be), or raise :class:`Reject`."""
        lim = self.limits
        if self.in_flight < lim.max_in_flight and not self.waiters:
            self.in_flight += 1
            return
        if len(self.waiters) >= lim.max_queued:
            self.metrics.rejected.labels("queue_full").inc()
            raise Reject(429, "router queue is full, retry later", "rate_limit_error", "1")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.metrics.queued.set(len(self.waiters))
        try:
            await asyncio.wait_for(asyncio.shield(fut), lim.queue_timeout_seconds)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # the slot was handed over at the last moment
            fut.cancel()
            self.metrics.rejected.labels("queue_timeout").inc()
            msg = "router overloaded: queue wait timed out"
            raise Reject(503, msg, "service_unavailable", "2") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            fut.cancel()
            raise
        finally:
            try:
                self.waiters.remove(fut)
            except ValueError:
                pass
            self.metrics.queued.set(len(self.waiters))

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; in_flight unchanged
                return
        self.in_flight -= 1
