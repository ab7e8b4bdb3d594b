"""In-process fakes for the router's unit tests: a scripted upstream client (the lean HTTP
client's interface), a recording client side, and a KV waiter. No sockets, no processes."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from pd_router import handoff, revision
from pd_router.config import Health, Pool, RouterConfig
from pd_router.discovery import EndpointPool
from pd_router.handoff.lmcache_notify import Ticket
from pd_router.legs import ClientGone, Legs
from pd_router.metrics import Metrics
from pd_router.pairs import HandoffPairs
from pd_router.request import Ctx, Outcomes
from pd_router.served import ServedModel


class FakeResponse:
    def __init__(
        self,
        status: int = 200,
        body: Any = b"",
        chunks: list[bytes] | None = None,
        ctype: str = "application/json",
        stall: bool = False,
    ) -> None:
        self.status = status
        self.headers = {"content-type": ctype}
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        self.chunks = chunks if chunks is not None else [raw]
        self.stall = stall  # a stream that sends its headers and then nothing
        self._on_done: Callable[[], None] | None = None
        self.done_calls = 0

    def _done(self) -> None:
        self.done_calls += 1
        cb, self._on_done = self._on_done, None
        if cb is not None:
            cb()

    complete = True  # the whole body is there at once

    async def first_data(self, timeout: float, beyond: int = 0) -> None:
        if self.stall:
            raise TimeoutError()

    def peek(self) -> bytes:
        return b"".join(self.chunks)

    async def iter_any(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c

    # upstream.Response's sink mode: each chunk handed on as it "arrives", until unsunk
    def sink(self, fn: Callable[[bytes], None]) -> None:
        self._sink: Callable[[bytes], None] | None = fn
        self._sunk = getattr(self, "_sunk", 0)
        while self._sunk < len(self.chunks) and self._sink is fn:
            self._sunk += 1
            fn(self.chunks[self._sunk - 1])

    def unsink(self) -> None:
        self._sink = None

    async def sink_wait(self) -> bool:
        return self._sink is not None and self._sunk == len(self.chunks)

    async def read_release(self) -> bytes:
        self.release()
        return b"".join(self.chunks)

    def release(self) -> None:
        self._done()

    def close(self) -> None:
        self._done()


class Held:
    """A call that is never answered (an engine waiting on something that will not come):
    ``reached`` is set once a call waits on it; only a cancellation ends it."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()

    async def hold(self) -> None:
        self.reached.set()
        await asyncio.Event().wait()


class FakeUpstream:
    """``post`` answers from a script per (port, path): a FakeResponse or an exception, in
    order; every call is recorded with its JSON body."""

    def __init__(self) -> None:
        self.script: dict[tuple[int, str], list[Any]] = defaultdict(list)
        self.calls: list[tuple[int, str, Any]] = []
        self.responses: list[FakeResponse] = []

    def on(self, port: int, path: str, *answers: Any) -> None:
        self.script[(port, path)].extend(answers)

    def calls_to(self, path: str) -> list[tuple[int, Any]]:
        return [(port, body) for port, p, body in self.calls if p == path]

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
    ) -> FakeResponse:
        self.calls.append((port, path, orjson.loads(body)))
        todo = self.script[(port, path)]
        answer = (
            todo.pop(0) if todo else ConnectionRefusedError(f"nothing scripted on {port}{path}")
        )
        if isinstance(answer, Held):
            try:
                await answer.hold()
            except BaseException:
                if on_done is not None:
                    on_done()
                raise
        if isinstance(answer, BaseException):
            if on_done is not None:
                on_done()
            raise answer
        answer._on_done = on_done
        self.responses.append(answer)
        return answer

    def close(self) -> None:
        pass


class FakeDownstream:
    """Records what the client would have received, and tells the request as
    legs.Downstream does (``ctx`` is bound by :class:`AsApp`, or by the test)."""

    def __init__(self, gone_after: int | None = None, gone_at_end: bool = False) -> None:
        self.status: int | None = None
        self.body = b""
        self.headers: dict[str, str] = {}
        self.events: list[bytes] = []
        self.ended = False
        self.gone_after = gone_after  # writes accepted before the client leaves
        self.gone_at_end = gone_at_end  # the client leaves after the last byte, before the end
        self.response: Any = None
        self.ctx: Ctx | None = None
        self._streaming = False

    @property
    def streaming(self) -> bool:
        return self._streaming

    def reply(self, status: int, body: bytes, headers: dict[str, str], ctype: str | None = None):
        self.status, self.body, self.headers = status, body, headers
        self.response = self
        assert self.ctx is not None
        self.ctx.replied(status)
        return self

    def error(self, status: int, message: str, etype: str, headers: dict[str, str] | None = None):
        body = orjson.dumps({"error": {"message": message, "type": etype, "code": status}})
        return self.reply(status, body, headers or {})

    async def open_stream(self, headers: dict[str, str]) -> None:
        self.status, self.headers, self._streaming, self.response = 200, headers, True, self

    async def write(self, data: bytes) -> None:
        assert self.ctx is not None
        if self.gone_after is not None and len(self.events) >= self.gone_after:
            self.ctx.client_gone()
            raise ClientGone
        self.events.append(data)

    def write_now(self, data: bytes) -> bool:
        assert self.ctx is not None
        if self.gone_after is not None and len(self.events) >= self.gone_after:
            self.ctx.client_gone()
            raise ClientGone
        self.events.append(data)
        return False  # the client keeps up

    async def drain(self) -> None:
        pass

    async def end(self) -> None:
        assert self.ctx is not None
        self.ended = not self.gone_at_end  # the end marker lost: the answer is whole anyway
        self.ctx.stream_ended()

    async def stream_error(self, message: str, etype: str = "upstream_error", code: int = 502):
        self.events.append(b"error: " + message.encode())
        self.ended = True
        assert self.ctx is not None
        self.ctx.stream_failed()

    def gone(self) -> None:
        assert self.ctx is not None
        self.ctx.client_gone()

    def json(self) -> Any:
        return orjson.loads(self.body)

    def sse(self) -> list[Any]:
        out = []
        for ev in b"".join(self.events).split(b"\n\n"):
            if ev.startswith(b"data: ") and ev != b"data: [DONE]":
                out.append(orjson.loads(ev[6:]))
        return out


class FakeWaiter:
    """A KV waiter whose answer the test sets ("ok", "timeout" or "error")."""

    def __init__(self, outcome: str = "ok") -> None:
        self.outcome = outcome
        self.expected: list[str] = []
        self.cancelled: list[str] = []
        self.waited: list[tuple[str, int]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def expect(self, req_id: str) -> Ticket:
        self.expected.append(req_id)
        return Ticket(req_id, None, 1)

    async def wait(self, ticket: Ticket, prefiller: Any) -> str:
        self.waited.append((ticket.req_id, prefiller.port))
        return self.outcome

    def cancel(self, ticket: Ticket) -> None:
        self.cancelled.append(ticket.req_id)


def pool(name: str, *ports: int) -> EndpointPool:
    p = EndpointPool(name, Pool(discovery="static"), Health())
    p.set_endpoints([f"http://127.0.0.1:{port}" for port in ports])
    for ep in p.endpoints.values():
        ep.healthy = True
        ep.revision = revision.NONE  # as discovery learns of an engine that names none
    p._refresh_healthy()
    return p


class World:
    """Legs over a fake upstream, with prefillers and decoders on the given ports."""

    def __init__(self, prefill: tuple[int, ...] = (9001,), decode: tuple[int, ...] = (9101,)):
        self.cfg = RouterConfig()
        self.metrics = Metrics()
        self.outcomes = Outcomes(self.metrics)
        self.up = FakeUpstream()
        self.prefill = pool("prefill", *prefill)
        self.decode = pool("decode", *decode)
        self.legs = Legs(
            self.cfg.timeouts,
            self.up,
            self.prefill,
            self.decode,
            self.outcomes,
            ServedModel("m"),
            HandoffPairs(self.cfg.health),
        )

    def direct(self) -> AsApp:
        """The direct route, as the app runs it."""
        d = handoff.DirectRoute(self.legs)
        return AsApp(self, d, d)

    def ep(self, port: int):
        for p in (self.prefill, self.decode):
            for e in p.endpoints.values():
                if e.port == port:
                    return e
        raise KeyError(port)

    def load(self) -> list[tuple[int, int]]:
        """(active, queued_tokens) of every endpoint: all zero once a request is over."""
        eps = [*self.prefill.endpoints.values(), *self.decode.endpoints.values()]
        return [(e.active, e.queued_tokens) for e in eps]

    def sample(self, name: str, **labels: str) -> float:
        v = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v


class AsApp:
    """A route as the app runs it: through ``handoff.run`` (a fallback it raises is served by
    one decoder) and counted once where the request ends (``Outcomes.finish``)."""

    def __init__(self, world: World, route: Any, direct: Any) -> None:
        self.world, self.route, self.direct = world, route, direct

    async def serve(self, c: Ctx, down: Any) -> Any:
        down.ctx = c  # as the app builds its Downstream(request, ctx)
        try:
            return await handoff.run(self.route, self.direct, c, down)
        finally:
            self.world.outcomes.finish(c)

    async def passthrough(self, c: Ctx, down: Any) -> Any:
        down.ctx = c
        try:
            return await self.direct.passthrough(c, down)
        finally:
            self.world.outcomes.finish(c)


def ctx(body: dict[str, Any], chat: bool = False, path: str | None = None) -> Ctx:
    c = Ctx("rid1", chat, path or ("/v1/chat/completions" if chat else "/v1/completions"))
    c.body = body
    c.raw = orjson.dumps(body)
    c.stream = body.get("stream") is True
    return c
