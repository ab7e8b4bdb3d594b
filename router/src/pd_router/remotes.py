"""Several base models behind one endpoint: the other releases' routers this router fronts
(``remoteModels``; docs/lora.md "Several base models").

One release of the chart serves one base model, with its own pools, decision settings, revision
pairing and KV-event index, and is upgraded, rolled back or removed on its own. A platform team
that wants one endpoint for several models gives one release's router the others' routers:
a request whose ``model`` names a remote model is relayed to that model's router as the client
sent it (body, path, Content-Type, Authorization, request id, trace context) and the answer
relayed back as it comes, with that router's ``x-pd-*`` headers: the router that serves the
model decides, disaggregates, retries and counts it. Here it is admitted under this router's
limits and counted under route ``remote`` with the remote model's name as its ``model`` label
(bounded by the config, never by what a client sends).

The names routed to a remote: its ``name``, the LoRA adapters its router lists under it
(cards whose ``parent`` is the name, as vLLM writes them), and its KV revisions' names
(``<name>@kv-<revision>``, pd_router.revision). This router's own names are looked up first and
never learnt from a remote (nor another remote's ``name``): a remote cannot take them over. Its
list is asked of it every ``health.intervalSeconds`` (within three times
``health.timeoutSeconds``: that router may ask two engines), with the first of this router's own
API keys when it has some (releases fronted by one endpoint share their keys), the last good
answer kept; until one arrives, only ``name`` and its revisions are routed there. A remote that
cannot be reached answers 503 (connect), 504 (timeouts): its answer's headers may take what
that router's own prefill and first byte may (``timeouts.prefillSeconds`` +
``firstByteSeconds``), a stream's chunks ``streamIdleSeconds`` apart.

Hand-off fields (``kv_transfer_params``) are stripped here as for any request, whatever the
remote does; the session affinity header (``routing.sessionAffinityHeader``) goes with the
request. A relayed request carries ``X-PD-Relayed``: a router that receives one for a model it
would relay again answers 508, so a ``url`` that points back at a front cannot loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from pd_router import revision
from pd_router.auth import ApiKeys
from pd_router.config import Health, RemoteModel, Timeouts
from pd_router.discovery import Endpoint
from pd_router.failures import UPSTREAM_ERRORS
from pd_router.http1 import Answer, Headers
from pd_router.legs import JSON, ClientGone, Downstream, Legs, leg_headers, leg_span
from pd_router.openai_wire import model_card
from pd_router.request import REMOTE, Ctx
from pd_router.served import ASKED
from pd_router.tracing import Trace
from pd_router.upstream import UpstreamClient

log = logging.getLogger("pd_router")

__all__ = ["REMOTE", "Remote", "Remotes"]

SSE = "text/event-stream"
RELAYED = "x-pd-relayed"  # on a request one router relays to another
RELAYED_LINE = b"X-PD-Relayed: 1\r\n"


class Remote:
    """One remote model: its router and what that router lists under its name."""

    def __init__(self, spec: RemoteModel) -> None:
        self.name = spec.name
        self.ep = Endpoint(spec.url)
        self.adapters: frozenset[str] = frozenset()  # learnt from its /v1/models
        self.cards: list[dict[str, Any]] = []  # its own card first, then its adapters'
        self.clash: list[str] = []  # adapters it lists under names taken here (left out)
        self.listed: bool | None = None  # whether its last ask got a list (None: not asked)

    def serves(self, model: str) -> bool:
        return (
            model == self.name
            or model in self.adapters
            or revision.of_alias(model, self.name) is not None
        )

    def learn(self, answer: Any, taken: Callable[[str], bool]) -> bool:
        """Its cards from a /v1/models answer, leaving out adapters whose name is ``taken``
        (this router's own, another remote's): False when the answer has no card of it."""
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            return False
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
        own = [c for c in cards if c["id"] == self.name]
        if not own:
            return False
        adapters = [c for c in cards if c.get("parent") == self.name and c["id"] != self.name]
        clash = sorted(c["id"][:64] for c in adapters if taken(c["id"]))
        if clash and clash != self.clash:
            log.warning(
                "remote model %s lists adapters named as other models: %s", self.name, clash
            )
        self.clash = clash
        adapters = [c for c in adapters if not taken(c["id"])]
        self.cards = own[:1] + adapters
        self.adapters = frozenset(c["id"] for c in adapters)
        return True


class Remotes:
    """The remote models of one router, by the names routed to each."""

    def __init__(
        self,
        specs: Sequence[RemoteModel],
        up: UpstreamClient,
        health: Health,
        timeouts: Timeouts,
        legs: Legs,
        own: Callable[[str], bool],
        affinity_header: str | None = None,
    ) -> None:
        """``own(name)``: whether ``name`` is this router's own (its model, an adapter, a KV
        revision's name); ``affinity_header``: the session affinity header, lower case."""
        self.all = [Remote(s) for s in specs]
        self.by_name = {r.name: r for r in self.all}
        self.own = own
        self.affinity_header = affinity_header
        self.up = up
        self.health = health
        self.timeouts = timeouts
        self.legs = legs
        self.keys: ApiKeys | None = None  # the router's own: the first is sent to the remotes

    def __bool__(self) -> bool:
        return bool(self.all)

    @property
    def names(self) -> tuple[str, ...]:
        """The ``model`` label values of relayed requests."""
        return tuple(r.name for r in self.all)

    def of(self, model: Any) -> Remote | None:
        """The remote that serves ``model``, or None."""
        if not isinstance(model, str):
            return None
        r = self.by_name.get(model)
        if r is not None:
            return r
        for r in self.all:
            if r.serves(model):
                return r
        return None

    def _taken(self, name: str) -> bool:
        return name in self.by_name or self.own(name)

    def cards(self) -> list[dict[str, Any]]:
        """Every remote model's cards as its router last listed them (its router's own card
        for one never listed)."""
        out: list[dict[str, Any]] = []
        for r in self.all:
            out += r.cards or [model_card(r.name, None, int(time.time()))]
        return out

    # ------------------------------------------------------------------ their lists
    async def run(self) -> None:
        """Ask every remote for its list, then again every ``health.intervalSeconds``."""
        while True:
            await asyncio.gather(*(self.refresh(r) for r in self.all))
            await asyncio.sleep(self.health.interval_seconds)

    async def refresh(self, r: Remote) -> None:
        # that router may ask two engines for their cards, each within the same timeout
        t = self.health.timeout_seconds * (ASKED + 1)
        ep = r.ep
        key = self.keys.first() if self.keys is not None else None
        headers = b"" if not key else b"Authorization: Bearer %s\r\n" % key.encode()
        try:
            async with asyncio.timeout(t):
                resp = await self.up.get(ep.host, ep.port, ep.tls, "/v1/models", headers, t, t)
                raw = await resp.read_release()
            ok = resp.status == 200 and r.learn(orjson.loads(raw), self._taken)
            why = f"answered {resp.status} without a card of {r.name!r}"
        except (*UPSTREAM_ERRORS, orjson.JSONDecodeError) as exc:
            ok, why = False, repr(exc)
        if ok != r.listed:  # once per change, not every interval
            if ok:
                log.info("remote model %s: %s lists it", r.name, ep.base)
            else:
                log.warning("remote model %s: GET %s/v1/models %s", r.name, ep.base, why)
        r.listed = ok

    # ------------------------------------------------------------------ a request
    async def relay(
        self, r: Remote, ctx: Ctx, down: Downstream, request_headers: Headers
    ) -> Answer:
        """``ctx.raw`` to ``ctx.path`` on ``r``'s router, its answer relayed back."""
        if request_headers.get(RELAYED) is not None:
            msg = (
                f"relay loop: model {r.name!r} came from another router and would be relayed again"
            )
            return down.error(508, msg, "upstream_error", ctx.reply_headers())
        ep, t = r.ep, self.timeouts
        span = leg_span(ctx, REMOTE, ep, ctx.path)  # that router's trace continues this one
        headers = leg_headers(ctx, span) + RELAYED_LINE
        # values http1 parsed: no CR or LF in them
        auth = request_headers.get("authorization")
        if auth:
            headers += b"Authorization: %s\r\n" % auth.encode("utf-8", "surrogateescape")
        if self.affinity_header and ctx.affinity:
            name = self.affinity_header.encode()
            headers += b"%s: %s\r\n" % (name, ctx.affinity.encode("utf-8", "surrogateescape"))
        try:
            resp = await self.up.post(
                ep.host,
                ep.port,
                ep.tls,
                ctx.path,
                ctx.raw,
                headers,
                t.prefill_seconds + t.first_byte_seconds,  # that router's own, both legs
                t.stream_idle_seconds,
            )
        except UPSTREAM_ERRORS as exc:
            timed_out = isinstance(exc, TimeoutError)
            if span is not None:
                Trace.end(span, "timeout" if timed_out else "connect")
            status = 504 if timed_out else 503
            what = "did not answer in time" if timed_out else "cannot be reached"
            hdrs = ctx.reply_headers()
            if status == 503:
                hdrs["Retry-After"] = "2"
            msg = f"the router of model {r.name!r} {what}"
            return down.error(status, msg, "upstream_error", hdrs)
        if span is not None:
            span.attrs["http.response.status_code"] = resp.status
        # how that router served it (x-pd-*), and when to ask again (its 429 and 503)
        hdrs = {k: v for k, v in resp.headers.items() if k.startswith("x-pd-")}
        if "retry-after" in resp.headers:
            hdrs["Retry-After"] = resp.headers["retry-after"]
        hdrs["x-request-id"] = ctx.rid
        ctype = resp.headers.get("content-type", JSON)
        hdrs["Content-Type"] = ctype
        if resp.status == 200 and ctype.startswith(SSE):
            if span is not None:
                Trace.end(span)  # the stream's own outcome is the request's
            hdrs["Cache-Control"] = "no-cache"
            try:
                await down.open_stream(hdrs)
            except ClientGone:
                resp.close()
                assert down.response is not None
                return down.response
            except BaseException:
                resp.close()
                raise
            return await self.legs.pump(ctx, down, resp, ep, remote=True)
        try:
            data = await resp.read_release()
        except UPSTREAM_ERRORS as exc:
            resp.close()
            timed_out = isinstance(exc, TimeoutError)
            if span is not None:
                Trace.end(span, "timeout" if timed_out else "stream")
            return down.error(
                504 if timed_out else 502, f"the router of model {r.name!r} failed its answer",
                "upstream_error", ctx.reply_headers(),
            )  # fmt: skip
        if span is not None:
            Trace.end(span)
        return down.reply(resp.status, data, hdrs)
