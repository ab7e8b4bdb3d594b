"""The legs of a request: the client side (:class:`Downstream`) and the engine calls
(:class:`Legs`): open a decoder response with the ONE retry loop, run a prefill, ask an
engine's /tokenize, relay or pump a decoder's answer to the client.

Every engine call holds a :class:`~pd_router.lease.Lease` on its endpoint, bound to the
upstream response, and every failure is a :class:`~pd_router.failures.LegError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from pd_router import adapters, balancing, http1, revision
from pd_router.config import Timeouts
from pd_router.costs import Job
from pd_router.discovery import Endpoint, EndpointPool
from pd_router.failures import UPSTREAM_ERRORS, LegError, TokenizeError
from pd_router.http1 import Answer, Request
from pd_router.lease import Lease
from pd_router.openai_wire import (
    COMPLETION_PATHS,
    error_body,
    error_detail,
    sse_error,
    stream_opening,
    tokenize_request,
)
from pd_router.pairs import HandoffPairs
from pd_router.request import Ctx, Fallback, Outcomes
from pd_router.served import ServedModel
from pd_router.tracing import CLIENT, Span, Trace
from pd_router.upstream import Response, UpstreamClient

log = logging.getLogger("pd_router")

Relabel = Callable[[bytes], bytes]


class ClientGone(Exception):
    """The client disconnected (or stopped reading) while we streamed to it."""


class Downstream:
    """The client side of one request. Routes answer through it, never through the server
    directly: ``reply`` (a whole answer) or ``open_stream`` / ``write`` / ``end`` (SSE). What
    reached the client is recorded on the request as it goes (``Ctx.replied``, ...): the one
    place its outcome comes from."""

    __slots__ = ("_request", "ctx", "response")

    def __init__(self, request: Request, ctx: Ctx) -> None:
        self._request = request
        self.ctx = ctx
        self.response: Answer | None = None

    @property
    def streaming(self) -> bool:
        return self.response is not None and self.response.prepared

    def reply(
        self, status: int, body: bytes, headers: dict[str, str], ctype: str | None = None
    ) -> Answer:
        if ctype is not None:
            self.response = http1.Response(
                status=status, body=body, content_type=ctype, headers=headers
            )
        else:
            self.response = http1.Response(status=status, body=body, headers=headers)
        self.ctx.replied(status)
        return self.response

    def error(
        self, status: int, message: str, etype: str, headers: dict[str, str] | None = None
    ) -> Answer:
        return self.reply(status, error_body(status, message, etype), headers or {}, JSON)

    async def open_stream(self, headers: dict[str, str]) -> None:
        """Send 200 and the headers of a stream; :class:`ClientGone` if the client left."""
        out = self.response = http1.StreamResponse(status=200, headers=headers)
        try:
            await out.prepare(self._request)
        except ConnectionError:
            self.ctx.client_gone()
            raise ClientGone from None

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except ConnectionError:
            self.ctx.client_gone()
            raise ClientGone from None

    def write_now(self, data: bytes) -> bool:
        """Write without waiting: True when the client reads too slowly and :meth:`drain`
        must come before more; :class:`ClientGone` if it left."""
        assert self.response is not None
        try:
            return self.response.write_now(data)
        except ConnectionError:
            self.ctx.client_gone()
            raise ClientGone from None

    async def drain(self) -> None:
        assert self.response is not None
        try:
            await self.response.drain()
        except ConnectionError:
            self.ctx.client_gone()
            raise ClientGone from None

    async def end(self) -> None:
        """The stream's end. Every byte of the answer is written by then: a client gone before
        the end marker is not a disconnect (the openai client closes on ``data: [DONE]``)."""
        assert self.response is not None
        with contextlib.suppress(ConnectionError):
            await self.response.write_eof()
        self.ctx.stream_ended()

    async def stream_error(
        self, message: str, etype: str = "upstream_error", code: int = 502
    ) -> None:
        """End a stream whose 200 is already sent with an error event (best effort)."""
        assert self.response is not None
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.response.write(sse_error(message, etype, code))
            await self.response.write_eof()
        self.ctx.stream_failed()

    def gone(self) -> None:
        """The client stopped reading (a stream's progress guard fired)."""
        self.ctx.client_gone()


def leg_span(ctx: Ctx, name: str, ep: Endpoint, path: str) -> Span | None:
    """A CLIENT span for an engine call of a traced request (None when not traced), described
    as OTel's HTTP client conventions say."""
    tr = ctx.trace
    if tr is None:
        return None
    attrs: dict[str, Any] = {
        "http.request.method": "POST",
        "server.address": ep.host,
        "server.port": ep.port,
        "url.path": path,
        "pd.engine": ep.base,
    }
    if ep.revision:
        attrs["pd.kv_revision"] = ep.revision
    return tr.span(name, CLIENT, attrs)


def leg_headers(ctx: Ctx, span: Span | None) -> bytes:
    """The header block of an engine call: its span's trace context when traced."""
    if span is None or ctx.trace is None:
        return ctx.headers
    return ctx.trace.headers(ctx.headers, span)


class LegSpan:
    """``with LegSpan(ctx, name, ep, path) as span:`` an engine call's CLIENT span (None when
    not traced), ended as the block ends: with the fallback's reason, or ``tokenize_error``,
    when one of those ends it; a cancelled call's ends with the request."""

    __slots__ = ("span",)

    def __init__(self, ctx: Ctx, name: str, ep: Endpoint, path: str) -> None:
        self.span = leg_span(ctx, name, ep, path)

    def __enter__(self) -> Span | None:
        return self.span

    def __exit__(self, etype: Any, exc: BaseException | None, tb: Any) -> None:
        span = self.span
        if span is None:
            return
        if exc is None:
            Trace.end(span)
        elif isinstance(exc, Fallback):
            Trace.end(span, exc.reason)
        elif isinstance(exc, TokenizeError):
            Trace.end(span, "tokenize_error")


JSON = "application/json"


def _timed(ctx: Ctx, itl_h: Any, job: Job | None, last: float) -> float:
    """A stream's piece reached the client now (returned): its gap since the ``last`` one to
    the ITL histogram and the goodput cost model, or, the first, the request's first token."""
    now = time.perf_counter()
    if last:
        itl_h.observe(now - last)
        if job is not None:
            job.gap(now - last, now)
    else:
        ctx.t_first = now
    return now


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class _DecoderTries:
    """One :meth:`Legs.open_decoder`'s state: the decoders tried and avoided, the last
    failure, and what the next try sends."""

    __slots__ = ("avoid", "data", "handoff", "last", "prefer", "retry_data", "tried")

    def __init__(
        self,
        data: bytes,
        retry_data: bytes | None,
        prefer: Endpoint | None,
        exclude: Sequence[Endpoint],
    ) -> None:
        self.data = data
        self.retry_data = retry_data
        # still the hand-off attempt: ``data`` carries the prefiller's KV, until a retry (or
        # the KV's own prefiller as decoder) sends ``retry_data`` instead
        self.handoff = retry_data is not None
        self.prefer = prefer
        self.avoid: list[Endpoint] = list(exclude)
        self.tried: list[Endpoint] = []
        self.last: LegError | None = None

    def pick(self, healthy: list[Endpoint], affinity: str | None) -> Endpoint | None:
        """The next decoder to try: ``prefer`` first, then the balancer's choice among those
        not tried nor avoided; None when no decoder is left."""
        if self.prefer is not None:
            ep, self.prefer = self.prefer, None
            self.avoid.append(ep)
            return ep
        ep = balancing.pick(healthy, balancing.decode_load, affinity, self.tried + self.avoid)
        if ep is None and self.avoid and all(e in self.avoid for e in self.tried):
            # only avoided decoders are healthy: better one of them than nothing
            self.avoid = []
            return balancing.pick(healthy, balancing.decode_load, affinity)
        if ep is None and self.tried and self.handoff:
            # the hand-off failed where no other decoder is left: the same one, once more,
            # without it (a KV load that failed says nothing of the decoder)
            return balancing.pick(healthy, balancing.decode_load, affinity)
        return ep

    def drop_handoff(self) -> None:
        """From here on, tries send ``retry_data`` (the route becomes ``fallback``)."""
        assert self.retry_data is not None
        self.data = self.retry_data
        self.handoff = False


class Legs:
    def __init__(
        self,
        timeouts: Timeouts,
        up: UpstreamClient,
        prefill: EndpointPool,
        decode: EndpointPool,
        outcomes: Outcomes,
        model: ServedModel,
        pairs: HandoffPairs,
    ) -> None:
        self.t = timeouts
        self.up = up
        self.prefill_pool = prefill
        self.decode_pool = decode
        # pools.layout flexible: one pool in both roles (an engine never prefills for itself)
        self.flexible = prefill is decode
        self.outcomes = outcomes
        self.pairs = pairs  # hand-off health per (prefiller, decoder): pd_router.pairs
        self.model = model  # its context length, learnt from /tokenize too
        self.served = model.name
        self.t_tokenize = min(30.0, timeouts.first_byte_seconds)
        # a streaming client that accepts nothing for this long is dropped
        self.stall = 2 * timeouts.stream_idle_seconds

    # ------------------------------------------------------------------ engine health
    # Every leg's outcome for its engine reaches the engine's pool through these two alone
    # (passive health, pd_router.discovery), so what counts either way is read in one place.
    def engine_ok(self, pool: EndpointPool, ep: Endpoint) -> None:
        """``ep`` served its leg, all of it: a decoder's answer began; a prefill answered and
        its hand-off proved what it must (LMCache: the KV's notification). Its run of failures
        ends."""
        pool.report_success(ep)

    def engine_failed(self, pool: EndpointPool, ep: Endpoint) -> None:
        """``ep`` failed its leg (connect error, timeout, 5xx, an unreadable or broken answer,
        a hand-off's notification failed or missing, a decoder that answered that it could not
        read a NIXL prefill's KV): one more toward its ejection."""
        pool.report_failure(ep)

    # ------------------------------------------------------------------ the pair
    def pair(self, ctx: Ctx, preferred: Endpoint | None = None) -> tuple[Endpoint, Endpoint]:
        """The decoder and the prefiller of a hand-off (balancing.pair: one KV revision and
        weight set, the decision's decoder first, then ``preferred`` as prefiller); sets
        ``ctx.decoder``. Raises :class:`Fallback` (``no_prefiller``, ``no_revision_pair``,
        ``weights_differ``, ``handoff_failing``) while the request can still be served whole,
        :class:`LegError` when no decoder is healthy."""
        prefillers = self.prefill_pool.healthy
        if not prefillers or (self.flexible and len(prefillers) < 2):
            raise Fallback("no_prefiller")  # (flexible: an engine never prefills for itself)
        decoders = self.decode_pool.healthy
        usable = healthy_pairs = self.pairs.usable if self.pairs.any_out else None
        w = ctx.wanted
        if w is not None:  # a LoRA adapter or a KV revision (pd_router.adapters)
            decoders, prefillers = w.engines(decoders), w.engines(prefillers)
            if not prefillers or (self.flexible and len(prefillers) < 2):
                raise Fallback("no_adapter_pair" if w.adapter is not None else "no_revision_pair")
            if w.adapter is not None:  # and one version of it on both sides
                usable = adapters.both(healthy_pairs, adapters.same_adapter(w.adapter))
        chosen = balancing.pair(decoders, prefillers, ctx.decoder, ctx.affinity, preferred, usable)
        if chosen is None:
            if not decoders:
                raise LegError.no_decoder()
            if usable is not healthy_pairs and balancing.pair(
                decoders, prefillers, usable=healthy_pairs
            ):
                raise Fallback("no_adapter_pair")  # the adapter's versions differ (a roll)
            if healthy_pairs is not None and balancing.pair(decoders, prefillers) is not None:
                raise Fallback("handoff_failing")  # every pair there is failed lately
            # no decoder of a live prefiller's revision, or only of other weights under it
            revs = {p.revision for p in prefillers if p.pairing is not None}
            if any(d.revision in revs for d in decoders if d.pairing is not None):
                raise Fallback("weights_differ")
            raise Fallback("no_revision_pair")  # (or the weights of one side not read yet)
        ctx.decoder = chosen[0]
        return chosen

    # ------------------------------------------------------------------ decoders
    async def open_decoder(
        self,
        ctx: Ctx,
        path: str,
        data: bytes,
        stream: bool,
        *,
        prefer: Endpoint | None = None,
        exclude: Sequence[Endpoint] = (),
        retry_data: bytes | None = None,
        named: bool = False,
        kv_source: Endpoint | None = None,
    ) -> tuple[Response, Endpoint]:
        """Open a response on a decoder: ``prefer`` first (the one holding a KV), then the
        balancer's choice, retrying other decoders on failures before the first byte (connect
        error, timeout, 5xx, a stream that ends or stalls before its first token). ``exclude``
        (and a failed ``prefer``) are avoided while another healthy decoder remains, then tried
        once. An upstream 4xx is returned as is. ``retry_data``: what retries send instead of
        ``data`` (the route becomes ``fallback``); with it, a decoder already tried gets it
        once when no other is left. ``named``: ``data`` names a KV revision's model
        (pd_router.revision), so a 404 is the decoder refusing that revision: it is asked its
        revision anew and ``retry_data`` goes out instead (fallback ``no_revision_pair``).
        ``kv_source``: the engine that prefilled ``data``'s KV: a try that carries its
        hand-off reports on it (:meth:`_decoder_attempt`); under the flexible layout it is a
        decoder too, never sent its own ``kv_transfer_params`` (vLLM 0.31/0.33 do not guard a
        handshake with themselves), only ``retry_data``. Raises the last
        :class:`LegError`."""
        out = self.outcomes
        idle = self.t.stream_idle_seconds if stream else self.t.first_byte_seconds
        if prefer is None and ctx.decoder is not None and ctx.decoder not in exclude:
            prefer = ctx.decoder  # the decision's (it may hold the prompt's prefix)
        tries = _DecoderTries(data, retry_data, prefer, exclude)
        while True:
            healthy = self.decode_pool.healthy
            if ctx.wanted is not None:
                healthy = ctx.wanted.engines(healthy)
            ep = tries.pick(healthy, ctx.affinity)
            if ep is None:
                raise tries.last or LegError.no_decoder()
            if tries.tried:
                out.retry("decode")
            if tries.handoff and (tries.tried or ep is kv_source):
                if tries.last is not None and tries.last.kind == "revision":
                    out.fallback(ctx, "no_revision_pair")
                else:
                    out.fallback(ctx, "decode_retry")
                tries.drop_handoff()
            tries.tried.append(ep)
            try:
                resp = await self._decoder_attempt(
                    ctx, ep, path, tries, stream, idle, named, kv_source
                )
            except LegError as err:
                tries.last = err
                continue
            return resp, ep

    async def _decoder_attempt(
        self,
        ctx: Ctx,
        ep: Endpoint,
        path: str,
        tries: _DecoderTries,
        stream: bool,
        idle: float,
        named: bool,
        kv_source: Endpoint | None,
    ) -> Response:
        """One of ``tries``, on ``ep``: traced, its outcome reported against the decoder (a
        revision it refused is relearnt, not counted). A try that carried ``kv_source``'s
        hand-off reports on the pair (pd_router.pairs): an answer (200) means the KV was read.
        A try the decoder answered with a failure (a 5xx, or a stream with no token: how vLLM
        fails a request whose KV load failed, though the router cannot tell that 500 from
        another) is the pair's failure, not the decoder's, which is up and serves the retry:
        the pair counts it toward its quarantine, and the streamed hand-offs still waiting on
        it for a first token are abandoned and served whole (``abandoned``, counted against
        nobody). Raises its :class:`LegError`."""
        span = leg_span(ctx, "decode", ep, path)
        kv = tries.handoff
        source = kv_source if kv else None
        if span is not None:
            span.attrs["pd.attempt"] = len(tries.tried)
            if tries.retry_data is not None:  # NIXL: the leg names the prefiller's KV blocks
                span.attrs["pd.kv_transfer_params"] = kv
        try:
            if source is None or not stream:
                resp = await self._try_decoder(
                    ctx, ep, path, tries.data, stream, idle, named and kv, span, kv
                )
            else:
                resp = await self._try_handoff(
                    ctx, ep, source, path, tries.data, stream, idle, named, span
                )
        except LegError as err:
            self._decoder_failed(ctx, ep, span, err, source)
            raise
        self.engine_ok(self.decode_pool, ep)
        if source is not None and resp.status == 200:
            self.engine_ok(self.prefill_pool, source)  # its KV was read: the hand-off held
            self.pairs.ok(source, ep)
        ctx.revision = ep.revision or ""
        ctx.engine = ep.base
        if span is not None:
            assert ctx.trace is not None
            ctx.trace.answer = span  # ends with the answer; first token then (Trace.close)
        return resp

    def _decoder_failed(
        self, ctx: Ctx, ep: Endpoint, span: Span | None, err: LegError, source: Endpoint | None
    ) -> None:
        """A failed try: its span ended, the decoder (or the hand-off's pair) counted, or the
        decoder relearnt; the failure logged."""
        if span is not None:
            Trace.end(span, err.kind)
        quiet = err.kind in ("5xx", "abandoned")  # (the engine's own log says why)
        if err.kind == "revision":
            self.decode_pool.relearn(ep)  # not a failure of the decoder: it runs other bits now
        elif err.kind == "abandoned":
            pass  # another hand-off on its pair failed: nobody's failure of its own
        elif source is not None and err.answered:
            self.pairs.failed(source, ep, err.kind, ctx.rid)  # the decoder is up; the KV was not
            quiet = True  # (logged there, naming both)
        else:
            self.engine_failed(self.decode_pool, ep)
        self.outcomes.upstream("decode", err.kind)
        if not quiet:
            log.warning("decoder %s failed: %s", ep.base, err.kind, extra={"request_id": ctx.rid})

    async def _try_handoff(
        self,
        ctx: Ctx,
        ep: Endpoint,
        source: Endpoint,
        path: str,
        data: bytes,
        stream: bool,
        idle: float,
        named: bool,
        span: Span | None,
    ) -> Response:
        """:meth:`_try_decoder` for a streamed hand-off from ``source``, abandoned
        (``LegError`` ``abandoned``) if another hand-off on the pair fails before its first
        token."""
        with self.pairs.waiting(source, ep) as w:
            try:
                async with w.scope:
                    return await self._try_decoder(
                        ctx, ep, path, data, stream, idle, named, span, True
                    )
            except TimeoutError:
                if not w.abandoned:
                    raise
        raise LegError("abandoned", 502)

    async def _try_decoder(
        self,
        ctx: Ctx,
        ep: Endpoint,
        path: str,
        data: bytes,
        stream: bool,
        idle: float,
        named: bool = False,
        span: Span | None = None,
        kv: bool = False,
    ) -> Response:
        """One try. A stream is only handed on once it has begun (:func:`stream_opening`: vLLM
        sends the headers at once, then the role, then the first token), so a decoder that
        accepts a stream and then dies, stalls for ``firstByteSeconds`` or ends it empty is
        still retried. ``kv``: ``data`` carries a prefiller's ``kv_transfer_params``."""
        fb = self.t.first_byte_seconds
        meter = ctx.meter
        kind = "decode" if kv else "whole"
        job = None if meter is None else meter.job(ep.base, ep.generation, kind)
        ctx.job = job
        lease = Lease(ep, 0, job)
        started = time.monotonic()
        try:
            resp = await self.up.post(
                ep.host,
                ep.port,
                ep.tls,
                path,
                data,
                leg_headers(ctx, span),
                fb,
                idle,
                lease.release,
            )
        except UPSTREAM_ERRORS as exc:
            raise LegError.of(exc) from None
        if span is not None:
            span.attrs["http.response.status_code"] = resp.status
        if resp.status >= 500:
            try:
                body = await resp.read_release()
            except UPSTREAM_ERRORS:
                body = b""
            raise LegError("5xx", resp.status, body, resp.headers.get("content-type", ""))
        if named and resp.status == 404:  # vLLM's "model ... does not exist": not this revision
            with contextlib.suppress(*UPSTREAM_ERRORS):
                await resp.read_release()
            raise LegError("revision", 502)
        if stream and resp.status == 200:
            try:  # firstByteSeconds counts from the request, headers included
                seen = 0
                while True:
                    await resp.first_data(max(0.0, fb - (time.monotonic() - started)), seen)
                    if path not in COMPLETION_PATHS:
                        break  # another API's events: relayed from their first byte
                    head = resp.peek()
                    opening = stream_opening(head)
                    if opening == "began":
                        if job is not None:
                            job.first(job.costs.clock())
                        break
                    if opening == "empty" or resp.complete:
                        raise LegError("stream", 502, answered=True)
                    seen = len(head)
            except UPSTREAM_ERRORS as exc:
                resp.close()  # the engine aborts the request
                raise LegError.of(exc, "stream") from None
            except BaseException:
                resp.close()
                raise
        return resp

    # ------------------------------------------------------------------ prefillers
    async def prefill(
        self,
        ctx: Ctx,
        ep: Endpoint,
        path: str,
        body: dict[str, Any],
        ntok: int,
    ) -> Any:
        """A non-streaming prefill request: its parsed JSON answer. The prefiller's load counts
        ``ntok`` prompt tokens meanwhile. A failure (connect, timeout, 5xx, an unreadable
        answer) counts against it and is a :class:`Fallback` (``prefill_error`` /
        ``prefill_timeout``); a 4xx refused the leg's body, not the client's (one output token,
        no stream, the hand-off fields: vLLM's message would speak of a request the client
        never sent), so a decoder answers the client's own (``prefill_refused``). Its success
        is the hand-off's to report (:meth:`engine_ok`): an answer may not be all it has to
        prove (LMCache: its notification)."""
        ctx.prefilled_on = ep.base
        with LegSpan(ctx, "prefill", ep, path) as span:
            meter = ctx.meter
            job = None if meter is None else meter.job(ep.base, ep.generation, "prefill")
            lease = Lease(ep, ntok, job)
            ps = self.t.prefill_seconds
            try:
                # headers within prefillSeconds, then no gap longer than prefillSeconds
                r = await self.up.post(
                    ep.host,
                    ep.port,
                    ep.tls,
                    path,
                    orjson.dumps(body),
                    leg_headers(ctx, span),
                    ps,
                    ps,
                    lease.release,
                )
                raw = await r.read_release()
            except UPSTREAM_ERRORS as exc:
                raise self.prefill_broken(ep, LegError.of(exc)) from None
            status = r.status
            if span is not None:
                span.attrs["http.response.status_code"] = status
            if revision.is_refusal(status, body, self.served):
                self.outcomes.upstream("prefill", "revision")
                self.prefill_pool.relearn(ep)  # it runs other bits than it said: ask it again
                raise Fallback("no_revision_pair")
            if 400 <= status < 500:
                raise Fallback("prefill_refused")
            if status != 200:
                raise self.prefill_broken(
                    ep, LegError("5xx" if status >= 500 else "bad_response", 502)
                )
            try:
                answer = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise self.prefill_broken(ep, LegError("bad_response", 502)) from None
            if job is not None:
                job.answered()
            return answer

    def prefill_broken(self, ep: Endpoint, err: LegError) -> Fallback:
        """Count a broken prefill leg against its prefiller; the fallback to raise."""
        self.outcomes.upstream("prefill", err.kind)
        self.engine_failed(self.prefill_pool, ep)
        return Fallback("prefill_timeout" if err.kind == "timeout" else "prefill_error")

    # ------------------------------------------------------------------ /tokenize
    async def tokenize(self, ctx: Ctx, ep: Endpoint, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids from an engine's /tokenize (vLLM v0.11
        ``TokenizeChatRequest``/``TokenizeCompletionRequest`` -> ``{count, max_model_len,
        tokens}``); learns ``max_model_len``. Raises :class:`TokenizeError`."""
        req = orjson.dumps(tokenize_request(body, chat, self.served))
        with LegSpan(ctx, "tokenize", ep, "/tokenize") as span:
            t = self.t_tokenize
            try:  # not leased: counting is not load the balancer should weigh
                async with asyncio.timeout(t):
                    resp = await self.up.post(
                        ep.host, ep.port, ep.tls, "/tokenize", req, leg_headers(ctx, span), t, t
                    )
                    data = await resp.read_release()
                if resp.status != 200:
                    raise TokenizeError(f"/tokenize answered {resp.status}")
                out = orjson.loads(data)
                toks = out["tokens"]
                mml = out.get("max_model_len")
            except UPSTREAM_ERRORS as exc:
                raise TokenizeError(f"/tokenize failed: {exc!r}") from None
            except (ValueError, KeyError, TypeError) as exc:  # orjson's error is a ValueError
                raise TokenizeError(f"/tokenize gave an unreadable answer: {exc!r}") from None
            if not isinstance(toks, list):
                raise TokenizeError("/tokenize returned no token list")
            self.model.learn(mml)
            return toks

    # ------------------------------------------------------------------ to the client
    def fail(self, ctx: Ctx, down: Downstream, err: LegError) -> Answer:
        """The answer when no engine could serve: the engine's own JSON 5xx if it sent one."""
        hdrs = ctx.reply_headers()
        if err.body is not None and err.ctype.startswith(JSON):
            return down.reply(err.status, err.body, hdrs, JSON)
        msg = {503: "no healthy decoder available", 504: "upstream timed out"}.get(
            err.status, "upstream engine failed"
        )
        if err.kind == "no_decoder" and ctx.wanted is not None:
            msg = f"no healthy decoder serves {ctx.wanted.what()}"
        if err.status == 503:
            hdrs["Retry-After"] = "2"
        return down.error(err.status, msg, "upstream_error", hdrs)

    async def error_detail(self, resp: Response, limit: int = 4096) -> tuple[str, str]:
        """(type, message) of an engine's error answer, from at most its first ``limit`` bytes
        (read under the response's idle timeout); the response is released."""
        buf = b""
        try:
            async with contextlib.aclosing(resp.iter_any()) as chunks:
                async for chunk in chunks:
                    buf += chunk
                    if len(buf) >= limit:
                        break
        except UPSTREAM_ERRORS:
            pass
        finally:
            resp.release()
        return error_detail(buf)

    async def relay(
        self, ctx: Ctx, down: Downstream, resp: Response, ep: Endpoint, stream: bool
    ) -> Answer:
        """Forward a decoder's answer as it is (bytes as they come, no re-encoding)."""
        hdrs = ctx.reply_headers()
        hdrs["Content-Type"] = resp.headers.get("content-type", JSON)
        if stream and resp.status == 200:
            hdrs["Cache-Control"] = "no-cache"
            try:
                await down.open_stream(hdrs)
            except ClientGone:
                resp.close()  # the engine aborts the request
                assert down.response is not None
                return down.response
            except BaseException:
                resp.close()
                raise
            return await self.pump(ctx, down, resp, ep)
        try:
            data = await resp.read_release()  # closed on failure or client disconnect
        except UPSTREAM_ERRORS as exc:
            err = LegError.of(exc, "stream")
            self.outcomes.upstream("decode", err.kind)
            self.engine_failed(self.decode_pool, ep)
            return self.fail(ctx, down, err)
        return down.reply(resp.status, data, hdrs)

    async def _relay_sunk(
        self,
        ctx: Ctx,
        down: Downstream,
        resp: Response,
        itl_h: Any,
        job: Job | None,
        stall: float,
    ) -> bool:
        """:meth:`pump` without a task wake-up or a timer per chunk: each chunk is written to
        the client in the upstream connection's callback (Response.sink) while the client keeps
        up, timed there (ITL, the cost model's gap); when it falls behind, chunks wait in the
        response while its writes drain, at most ``stall`` seconds (then False: it stopped
        reading). True once the body is relayed whole; raises ClientGone or the upstream's
        error (TimeoutError after its idle timeout)."""
        last = ctx.t_first
        gone = False

        def relay(chunk: bytes) -> None:
            nonlocal last, gone
            last = _timed(ctx, itl_h, job, last)
            try:
                behind = down.write_now(chunk)
            except ClientGone:
                gone = True
                behind = True
            if behind:
                resp.unsink()

        try:
            while True:
                resp.sink(relay)
                try:
                    if await resp.sink_wait():
                        return True
                except UPSTREAM_ERRORS:
                    if gone:  # the client left first: not the engine's failure
                        raise ClientGone from None
                    raise
                if gone:
                    raise ClientGone
                try:
                    async with asyncio.timeout(stall):
                        await down.drain()
                except TimeoutError:
                    down.gone()
                    return False
        finally:  # whatever ends it: nothing more is written from the engine's callback
            resp.unsink()

    async def pump(
        self,
        ctx: Ctx,
        down: Downstream,
        resp: Response,
        ep: Endpoint,
        relabel: Relabel | None = None,
        remote: bool = False,
    ) -> Answer:
        """Forward a decoder's SSE body to the open stream as it arrives: bytes as they are,
        or through ``relabel(chunk) -> bytes``. Owns ``resp`` (and so its lease). ``remote``:
        ``ep`` is another release's router (pd_router.remotes), not an engine of a pool."""
        out = self.outcomes
        itl_h = out.hist(ctx.route)[1]
        job = ctx.job  # the goodput decision's cost model learns each gap (pd_router.costs)
        ok = False
        last = ctx.t_first
        loop = asyncio.get_running_loop()
        stall = self.stall
        # The guard is moved on at most every `slack` seconds, not per chunk (a timer heap
        # operation per token was 7.6 % of a streaming router's samples): it fires between
        # `stall` and `stall + slack` after the stream last made progress.
        slack = stall / 4
        guard = None
        assert down.response is not None
        try:
            try:
                if relabel is None:  # the bytes as they are: handed on as they arrive
                    if not await self._relay_sunk(ctx, down, resp, itl_h, job, stall):
                        return down.response  # the client stopped reading
                    await down.end()
                    ok = True
                    return down.response
                # guard: a client that stops reading must not hold the stream forever
                async with asyncio.timeout(stall + slack) as guard:
                    move_at = loop.time() + slack
                    async for chunk in resp.iter_any():
                        last = _timed(ctx, itl_h, job, last)
                        data = chunk if relabel is None else relabel(chunk)
                        if data:
                            await down.write(data)
                        tick = loop.time()
                        if tick >= move_at:
                            guard.reschedule(tick + stall + slack)
                            move_at = tick + slack
            except ClientGone:
                return down.response
            except UPSTREAM_ERRORS:
                if guard is not None and guard.expired():
                    down.gone()
                    return down.response
                if remote:
                    out.upstream("remote", "stream")
                else:
                    out.upstream("decode", "stream")
                    self.engine_failed(self.decode_pool, ep)
                await down.stream_error("upstream stream failed")
                ok = True
                return down.response
            await down.end()
            ok = True
            return down.response
        finally:
            if ok:
                resp.release()
            else:
                resp.close()  # client went away: close so the engine aborts the request
