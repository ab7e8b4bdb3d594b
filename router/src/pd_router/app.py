"""HTTP surface of the router (pd_router.http1 on uvloop): routes, request id, auth, body read,
admission, validation, then the routing decision hands the request to its route.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /v1/models/{id}`` (the engines' cards), vLLM's other endpoints relayed to a decoder
(``openai_wire.PASSTHROUGH_PATHS``), ``GET /health`` (alive), ``GET /ready`` (a healthy decoder
exists), ``GET /metrics``; a known path asked with another method is 405 with ``Allow``.

A request's walk: ``app`` (admit -> read -> parse/validate) -> ``decide`` -> ``handoff.run``
(the chosen route; a Fallback it raises served directly) -> ``legs`` -> ``upstream``; each
module entered once, downward. The app knows no hand-off protocol, and it alone finishes a
request: ``Outcomes.finish`` counts, times and the access line logs it, however it ended.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import re
import time
from typing import Any

import aiohttp
import orjson

from pd_router import balancing, hub_tokenizer, revision, tracing, wiring
from pd_router.adapters import Names
from pd_router.admission import Admission, Reject
from pd_router.config import ConfigError, RouterConfig
from pd_router.decide import Decider, Pools
from pd_router.discovery import Endpoint, EndpointPool
from pd_router.failures import TokenizeError
from pd_router.handoff import DirectRoute, Route, build_route, run
from pd_router.http1 import Answer, BodyError, HttpServer, Request, Response, Routes
from pd_router.legs import Downstream, Legs
from pd_router.logs import AccessLog
from pd_router.metrics import MULTIPROC_ENV, Metrics
from pd_router.openai_wire import (
    MAX_JSON_DEPTH,
    PASSTHROUGH_PATHS,
    batch_reason,
    error_body,
    model_not_found,
    strip_handoff_fields,
    too_deep,
    validate,
)
from pd_router.pairs import HandoffPairs
from pd_router.remotes import Remotes
from pd_router.request import ENGINE_ROUTES, REMOTE, Ctx, Outcomes
from pd_router.served import ServedModel
from pd_router.tokens import TokenCounter, tokenizer_from_json
from pd_router.upstream import UpstreamClient

log = logging.getLogger("pd_router")
_ids = random.Random()  # request ids the router makes (not secrets: an id, not a key)
_RID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # fullmatch: "$" would admit a trailing newline
_CTYPE_RE = re.compile(r"[\x21-\x7e][\x20-\x7e]{0,255}")  # a Content-Type relayed to an engine


def error_response(status: int, message: str, etype: str, headers: Any = None) -> Response:
    return Response(
        status=status,
        body=error_body(status, message, etype),
        content_type="application/json",
        headers=headers,
    )


class Router:
    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None) -> None:
        """Assembles what pd_router.wiring builds from ``cfg``."""
        self.cfg = cfg
        self.metrics = m = metrics or Metrics()
        self.events = wiring.kv_event_index(cfg, m)
        self.prefill, self.decode = wiring.pools(cfg, self._pool_changed, self.events)
        self.pools = wiring.each_pool(self.prefill, self.decode)
        self.keys, self.metrics_tokens = wiring.api_keys(cfg)
        self.counter = TokenCounter(cfg.model.tokenizer, cfg.model.served_name)
        self.admission = Admission(cfg.limits, m)
        self.outcomes = Outcomes(m)
        self.up = UpstreamClient(cfg.timeouts.connect_seconds)  # hot path
        self.stall = wiring.stall_watch(cfg, self.up, self.pools, m)
        # its cards (and its adapters'), its context length
        self.served_model = ServedModel(cfg.model.served_name, cfg.model.adapters)
        self.pairs = HandoffPairs(cfg.health)  # hand-off health per pair (pd_router.pairs)
        self.legs = Legs(
            cfg.timeouts,
            self.up,
            self.prefill,
            self.decode,
            self.outcomes,
            self.served_model,
            self.pairs,
        )
        self.costs = wiring.cost_model(cfg, m)
        self.decider = Decider(cfg.routing, self.counter, self.events, self.costs, self.pairs)
        self.decider.base_names = (cfg.model.served_name,)
        self.decider.adapters = frozenset(cfg.model.adapters)
        # the model names served (pd_router.adapters): the served one, adapters, revisions
        self.names = Names(cfg.model.served_name, cfg.model.adapters)
        m.models(self.names.labels, ENGINE_ROUTES)
        # other base models, each its own release's (pd_router.remotes)
        self.affinity_header = (
            cfg.routing.session_affinity_header or ""
        ).lower() or None  # http1.Headers: lower-case names
        self.remotes = Remotes(
            cfg.remote_models,
            self.up,
            cfg.health,
            cfg.timeouts,
            self.legs,
            self.names.serves,
            self.affinity_header,
        )
        self.remotes.keys = self.keys
        m.remote_models(self.remotes.names, REMOTE)
        # The hand-off is chosen once, here (routing.connector), with all it needs.
        self.direct = DirectRoute(self.legs)
        self.disaggregated: Route = build_route(cfg, self.legs, self.direct)
        self.served = cfg.model.served_name
        self.session: aiohttp.ClientSession | None = None  # health checks
        self.access_log = AccessLog(log)  # after logs.setup: the level decides
        self.tracer = wiring.tracer(cfg, m)
        self._bg: list[asyncio.Task[None]] = []

    def _pool_changed(self, pool: EndpointPool) -> None:
        self.metrics.pool_changed(pool.name, len(pool.healthy), len(pool.endpoints), pool.healthy)
        if self.events is not None:
            self.events.sync(pool.name, pool.healthy)

    # ------------------------------------------------------------------ lifecycle
    async def _load_hub_tokenizer(self) -> None:
        hub = self.cfg.model.tokenizer_hub
        url = hub_tokenizer.tokenizer_url(hub)
        try:
            text = await hub_tokenizer.fetch_tokenizer_json(hub)
        except hub_tokenizer.HubUnavailable as exc:
            # a hub outage must not keep the router down: the engines' /tokenize is exact too
            log.error("tokenizer: %s; counting prompt tokens with the engines' /tokenize", exc)
            return
        self.counter.use(tokenizer_from_json(text, url), "hub")
        log.warning("tokenizer: loaded %s@%s from the hub", hub.repo, hub.revision)

    async def start(self) -> None:
        m = self.metrics
        if self.cfg.model.tokenizer_hub.repo:  # before the port opens: bad config stops here
            await self._load_hub_tokenizer()
        if self.tracer is not None:  # an unreadable headers file stops start-up, named
            try:
                self.tracer.start()
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for src in ("file", "hub"):
            m.tokenizer_loaded.labels(src).set(1 if self.counter.source == src else 0)
        await self.disaggregated.start()  # first: a port it binds, already taken, stops start-up
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=None
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies: skip cookie work
        )
        if self.events is not None:  # before discovery: its first engines are watched at once
            self.events.start(lambda outcome: self.metrics.kv_event_batches.labels(outcome).inc())
        await asyncio.gather(*(p.start(self.session) for p in self.pools))
        loop = asyncio.get_running_loop()
        if self.cfg.auth.api_keys_file or self.cfg.auth.metrics_tokens_file:
            self._bg.append(loop.create_task(self._keys_loop()))
        if os.environ.get(MULTIPROC_ENV):  # one of several workers: see _load_gauges
            self._bg.append(loop.create_task(self._gauges_loop()))
        if self.stall is not None:
            self._bg.append(loop.create_task(self.stall.run()))
        if self.remotes:
            self._bg.append(loop.create_task(self.remotes.run()))

    async def _keys_loop(self) -> None:
        while True:
            await asyncio.sleep(10)
            self.keys.maybe_reload()
            self.metrics_tokens.maybe_reload()

    def _load_gauges(self) -> None:
        """In-flight and outstanding counts, kept as gauges only when read: at a scrape, and
        every second in a worker (a scrape answered by another worker reads this one's)."""
        self.metrics.in_flight.set(self.admission.in_flight)
        for pool in self.pools:
            self.metrics.outstanding.labels(pool.name).set(
                sum(e.active for e in pool.endpoints.values())
            )

    async def _gauges_loop(self) -> None:
        while True:
            self._load_gauges()
            await asyncio.sleep(1)

    async def stop(self) -> None:
        for t in self._bg:
            t.cancel()
        if self.stall is not None:
            self.stall.stop()
        for pool in self.pools:
            await pool.stop()
        await self.disaggregated.stop()
        if self.events is not None:
            self.events.stop()
        self.counter.close()
        self.up.close()
        if self.session is not None:
            await self.session.close()
        if self.tracer is not None:  # what is queued goes out (off the loop: it may wait)
            await asyncio.to_thread(self.tracer.stop)

    # ------------------------------------------------------------------ auth
    def _authorized(self, request: Request) -> bool:
        return self.keys.check(request.headers.get("authorization"))

    def _metrics_authorized(self, request: Request) -> bool:
        """/metrics under ``protectMetrics``: an API key or a metrics-only token."""
        if not self.cfg.auth.protect_metrics:
            return True
        if not (self.keys.enabled or self.metrics_tokens.enabled):
            return True  # no credential configured anywhere (warned at start-up)
        header = request.headers.get("authorization")
        return self.keys.matches(header) or self.metrics_tokens.matches(header)

    # ------------------------------------------------------------------ simple routes
    async def health(self, request: Request) -> Response:
        return Response(body=b'{"status":"ok"}', content_type="application/json")

    async def ready(self, request: Request) -> Response:
        if self.decode.healthy:
            return Response(body=b'{"status":"ready"}', content_type="application/json")
        return Response(
            status=503, body=b'{"status":"no healthy decoder"}', content_type="application/json"
        )

    async def metrics_handler(self, request: Request) -> Response:
        if not self._metrics_authorized(request):
            return error_response(
                401, "invalid or missing API key or metrics token", "authentication_error"
            )
        self._load_gauges()
        return Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: vLLM's ``ModelList`` with the engines' card of the served
        model (openai/models/api_router.py, 0.31.0: ``ModelCard`` with ``created``,
        ``max_model_len``, ``root``, ``permission``, ...), each with ``kv_revisions``: the
        healthy engines of each pool by KV-compatibility revision (pd_router.revision), which
        shows a rollout's progress; the revisions' own names are the router's, not listed."""
        if not self._authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        cards, source = await self._model_cards()
        data = [self._with_revisions(c) for c in cards] + self.remotes.cards()
        return Response(
            body=orjson.dumps({"object": "list", "data": data}),
            content_type="application/json",
            headers={"x-pd-models-source": source},
        )

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``, as OpenAI answers it: the card; an unknown id gets
        vLLM's model-not-found 404 (vLLM 0.31.0 and 0.33.0 have no such route)."""
        if not self._authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        name = request.match_info["model_id"]
        remote = None if self.names.serves(name) else self.remotes.of(name)
        if remote is not None:
            card = next((c for c in self.remotes.cards() if c.get("id") == name), None)
            if card is None:  # a revision's name: not listed, as the router's own are not
                return Response(
                    status=404, body=model_not_found(name), content_type="application/json"
                )
            return Response(body=orjson.dumps(card), content_type="application/json")
        if name != self.served and name not in self.names.adapters:
            return Response(status=404, body=model_not_found(name), content_type="application/json")
        cards, source = await self._model_cards()
        card = next((c for c in cards if c.get("id") == name), None)
        if card is None:  # an adapter no engine lists now
            return Response(status=404, body=model_not_found(name), content_type="application/json")
        return Response(
            body=orjson.dumps(self._with_revisions(card)),
            content_type="application/json",
            headers={"x-pd-models-source": source},
        )

    async def _model_cards(self) -> tuple[list[dict[str, Any]], str]:
        # decoders first: a decoder serves every request (whole or its decode leg), so the
        # adapters listed are those a request can be served with; those that list the most
        # adapters first (mid-roll, one that lacks the newest would hide it)
        engines = list(dict.fromkeys([*self.decode.healthy, *self.prefill.healthy]))
        if self.names.adapters:
            engines.sort(key=lambda e: -len(e.adapters.keys() & self.names.adapters))
        return await self.served_model.cards(self.up, engines, self.cfg.health.timeout_seconds)

    def _with_revisions(self, card: dict[str, Any]) -> dict[str, Any]:
        live = {p.name: revision.census(p.healthy) for p in (self.prefill, self.decode)}
        return {**card, "kv_revisions": live}

    async def not_found(self, request: Request, allow: str | None) -> Response:
        """No route: 405 with ``Allow`` when the path has one under another method (what
        vLLM's FastAPI answers, there as ``{"detail": "Method Not Allowed"}``), else 404."""
        if allow:
            msg = f"Method {request.method} is not allowed for {request.path} (allowed: {allow})"
            return error_response(405, msg, "Method Not Allowed", {"Allow": allow})
        return error_response(404, f"no route for {request.path}", "not_found_error")

    # ------------------------------------------------------------------ OpenAI requests
    async def chat(self, request: Request) -> Answer:
        return await self._handle(request, True)

    async def completions(self, request: Request) -> Answer:
        return await self._handle(request, False)

    async def passthrough(self, request: Request) -> Answer:
        """One of vLLM's other endpoints (``PASSTHROUGH_PATHS``): to a decoder as it is."""
        return await self._handle(request, False, passthrough=True)

    async def _handle(self, request: Request, chat: bool, passthrough: bool = False) -> Answer:
        h = request.headers
        rid = h.get("x-request-id")
        if not rid or not _RID_RE.fullmatch(rid):
            rid = f"{_ids.getrandbits(128):032x}"  # uuid4's syscall per request is not needed
        trace, fwd, trace_id = None, b"", ""
        tp = h.get("traceparent")
        if self.tracer is not None:
            trace, fwd, trace_id = self.tracer.begin(
                tp, h.get("tracestate"), request.method, request.path
            )
        elif tp is not None:  # tracing off: the client's trace context passes through
            fwd, trace_id = tracing.forward(tp, h.get("tracestate"))
        ctx = Ctx(rid, chat, request.path, fwd, trace)
        ctx.trace_id = trace_id
        if trace is not None:
            trace.root.attrs["pd.request_id"] = rid
            trace.current = trace.span("admission")  # ends once it holds a slot, or is refused
        status = 0
        try:
            resp = await self._admit(request, ctx, passthrough)
            status = resp.status
            if not resp.prepared:  # the router's own answers (errors) carry the id too
                resp.headers.setdefault("x-request-id", rid)
            return resp
        except asyncio.CancelledError:
            ctx.client_gone()
            status = 499
            raise
        finally:  # the one place a request is counted, timed and logged, however it ended
            self.outcomes.finish(ctx)
            if ctx.trace is not None:
                self._close_trace(ctx, status)
            if self.access_log.enabled:
                duration_ms = round((time.perf_counter() - ctx.t0) * 1000, 2)
                self.access_log.write(
                    rid,
                    ctx.route,
                    ctx.reason,
                    status,
                    ctx.path,
                    duration_ms,
                    ctx.revision,
                    ctx.trace_id,
                    ctx.engine,
                    ctx.prefilled_on,
                )

    def _close_trace(self, ctx: Ctx, status: int) -> None:
        """The request's trace is complete: its outcome on the root span, then to the
        exporter."""
        tr = ctx.trace
        assert tr is not None and self.tracer is not None
        attrs: dict[str, Any] = {
            "http.response.status_code": status,
            "pd.route": ctx.route,
            "pd.reason": ctx.reason,
            "pd.outcome": ctx.outcome,
        }
        if ctx.revision:
            attrs["pd.kv_revision"] = ctx.revision
        error = ""
        if status >= 500 or ctx.outcome == "upstream_error":  # a stream can fail after its 200
            attrs["error.type"] = ctx.outcome or str(status)
            error = attrs["error.type"]
        tr.close(attrs, error, ctx.t_first)
        self.tracer.submit(tr)

    async def _admit(self, request: Request, ctx: Ctx, passthrough: bool = False) -> Answer:
        """auth -> body -> a slot -> serve. The body is read before a slot is taken, under its
        own deadline: a client that stalls half-way through sending it must not hold one of
        maxInFlight."""
        out = self.outcomes
        if not self._authorized(request):
            out.refused(ctx, "unauthorized")
            return error_response(401, "invalid or missing API key", "authentication_error")
        raw = await self._read_body(request, ctx)
        if isinstance(raw, Response):
            return raw
        try:
            await self.admission.acquire()
        except Reject as r:
            out.refused(ctx, "rejected")
            return error_response(r.status, r.message, r.etype, {"Retry-After": r.retry_after})
        tr = ctx.trace
        if tr is not None:  # admitted: later spans hang from the root
            tr.end(tr.current)
            tr.current = tr.root
        try:
            if passthrough:
                ctx.reason = "passthrough"  # not decided: vLLM's other endpoints go to a decoder
                bad = self._parse_passthrough(request, ctx, raw)
            else:
                bad = self._parse(request, ctx, raw)
            if bad is not None:
                out.refused(ctx, "bad_request")
                return bad
            if passthrough:
                self.metrics.passthrough.labels(ctx.path).inc()
                if ctx.remote is not None:
                    return await self._route(request, ctx)
                return await self.direct.passthrough(ctx, Downstream(request, ctx))
            return await self._route(request, ctx)
        finally:
            self.admission.release()

    async def _read_body(self, request: Request, ctx: Ctx) -> bytes | Response:
        lim = self.cfg.limits
        refused = self.outcomes.refused
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # vLLM does not decode request bodies either
            refused(ctx, "bad_request")
            msg = f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed"
            return error_response(415, msg, "invalid_request_error")
        if request.content_length is not None and request.content_length > lim.max_body_bytes:
            refused(ctx, "too_large")
            return error_response(413, "request body too large", "invalid_request_error")
        try:
            if request.body_complete:  # arrived with the head (most bodies): no deadline
                return await request.read()
            async with asyncio.timeout(self.cfg.timeouts.client_body_seconds):
                return await request.read()
        except TimeoutError:
            refused(ctx, "body_timeout")
            msg = "the request body did not arrive within timeouts.clientBodySeconds"
            return error_response(408, msg, "invalid_request_error")
        except BodyError as exc:  # a broken chunked body, or one over the limit
            if exc.too_large:
                refused(ctx, "too_large")
                return error_response(413, "request body too large", "invalid_request_error")
            refused(ctx, "bad_request")
            # llhttp's reason only: it never quotes the body (a prompt)
            return error_response(
                400, f"unreadable request body: {exc.message}", "invalid_request_error"
            )

    def _parse(self, request: Request, ctx: Ctx, raw: bytes) -> Response | None:
        """Fill ``ctx`` from the body, or the 400/404 answer for a body the router refuses."""
        body = _load_json(raw)
        if isinstance(body, Response):
            return body
        err = validate(body, ctx.chat)
        if err:
            return error_response(400, err, "invalid_request_error")
        model = body.get("model")
        try:
            ctx.wanted = self.names.wanted(model)
        except KeyError:  # this router's own names first: a remote never takes one over
            if not self._remote(ctx, model):
                return Response(
                    status=404, body=model_not_found(model), content_type="application/json"
                )
        else:
            ctx.model = self.names.label(model)
        if strip_handoff_fields(body):
            raw = orjson.dumps(body)
        ctx.raw = raw
        ctx.body = body
        ctx.stream = body.get("stream") is True
        if self.affinity_header:
            ctx.affinity = request.headers.get(self.affinity_header) or None
        if self.cfg.logging.log_prompts:
            log.info("prompt", extra={"request_id": ctx.rid, "body": body})
        return None

    def _parse_passthrough(self, request: Request, ctx: Ctx, raw: bytes) -> Response | None:
        """A body for one of vLLM's other endpoints goes to the engine as the client sent it,
        under the client's Content-Type (multipart for audio). A JSON body must parse, and
        hand-off fields are stripped from it (vLLM's Responses, Anthropic, Cohere and
        token-in/token-out requests take ``kv_transfer_params`` too: 0.31.0 protocol.py files);
        only then is it re-serialized. The engine validates the rest."""
        ctype = request.headers.get("content-type", "")
        if ctype and not _CTYPE_RE.fullmatch(ctype):
            return error_response(400, "unreadable Content-Type header", "invalid_request_error")
        ctx.headers = b"X-Request-Id: %s\r\n%s" % (ctx.rid.encode(), ctx.fwd)
        if ctype:
            ctx.headers = b"Content-Type: %s\r\n" % ctype.encode() + ctx.headers
        ctx.raw = raw
        if ctype.split(";", 1)[0].strip().lower() != "application/json" or not raw:
            return None
        body = _load_json(raw)
        if isinstance(body, Response):
            return body
        if isinstance(body, dict):
            if strip_handoff_fields(body):
                ctx.raw = orjson.dumps(body)
            ctx.body = body
            ctx.stream = body.get("stream") is True
            try:
                ctx.wanted = self.names.wanted(body.get("model"))  # an adapter's engines only
            except KeyError:  # another release's model, else the engine answers the name
                self._remote(ctx, body.get("model"))
        return None

    def _remote(self, ctx: Ctx, model: Any) -> bool:
        """Whether ``model``, a name this router does not serve, is another release's
        (pd_router.remotes): then ``ctx`` goes there."""
        r = self.remotes.of(model) if self.remotes else None
        if r is None:
            return False
        ctx.remote, ctx.route, ctx.reason, ctx.model = r, REMOTE, r.name, r.name
        return True

    async def _route(self, request: Request, ctx: Ctx) -> Answer:
        """decide -> the chosen route."""
        if ctx.remote is not None:
            return await self.remotes.relay(
                ctx.remote, ctx, Downstream(request, ctx), request.headers
            )
        decider, out = self.decider, self.outcomes
        decoders, prefillers = self.decode.healthy, self.prefill.healthy
        w = ctx.wanted
        if w is not None:  # a LoRA adapter or a KV revision: only the engines that serve it
            decoders, prefillers = w.engines(decoders), w.engines(prefillers)
        pools = Pools(decoders, prefillers, ctx.affinity)
        tr = ctx.trace
        if tr is not None:
            tr.current = tr.span("decision")
        d = await decider.decide(
            ctx.body, ctx.chat, functools.partial(self._engine_count, ctx), pools
        )
        ctx.t_decided = time.perf_counter()
        out.counted(d.source, d.tokens)
        if d.reason == "batch":
            out.batch(batch_reason(ctx.body, ctx.chat) or "n")
        ctx.ptok = d.tokens or 0
        ctx.ids = d.ids
        ctx.reason = d.reason
        if d.blocks is not None and d.decoder is not None:
            out.prefix(d.matched, (d.tokens or 0) - d.matched, d.estimate)
            ctx.decoder = d.decoder
            ctx.prefiller = d.prefiller
            ctx.cached, ctx.cached_source = d.matched, d.estimate
            # what it will hold once this prompt is prefilled there (or its KV lands there)
            decider.remember(d.decoder, d.blocks, self.decode.endpoints.values())
            if d.prefiller is not None and self.prefill is self.decode:
                decider.remember(d.prefiller, d.blocks, self.decode.endpoints.values())
        if d.option is not None:  # the goodput decision: its prediction and cost meter
            ctx.predicted, ctx.meter, ctx.prefiller = d.option, d.meter, d.option.prefiller
        route = self.disaggregated if d.disaggregate else self.direct
        if tr is not None:
            self._trace_decision(ctx, d)
        ctx.decided = True
        return await run(route, self.direct, ctx, Downstream(request, ctx))

    def _trace_decision(self, ctx: Ctx, d: Any) -> None:
        tr = ctx.trace
        assert tr is not None
        span = tr.current
        a = span.attrs
        a["pd.decision.route"] = "disaggregated" if d.disaggregate else "direct"
        a["pd.decision.reason"] = d.reason
        a["pd.decision.threshold"] = self.cfg.routing.threshold
        a["pd.prompt_tokens.source"] = d.source
        if d.tokens is not None:
            a["pd.prompt_tokens"] = d.tokens
        if ctx.cached_source:
            a["pd.cached_tokens"] = ctx.cached
            a["pd.cached_tokens.source"] = ctx.cached_source
        if ctx.decoder is not None:
            a["pd.decoder"] = ctx.decoder.base
        if ctx.prefiller is not None:
            a["pd.prefiller"] = ctx.prefiller.base
        o = ctx.predicted
        if o is not None:
            a["pd.predicted.ttft_ms"] = round(o.ttft * 1000, 1)
            a["pd.predicted.itl_ms"] = round(o.itl * 1000, 1)
            a["pd.predicted.misses"] = o.misses
            a["pd.predicted.held_up"] = o.held_up
        tr.end(span)
        tr.current = tr.root

    async def _engine_count(self, ctx: Ctx, body: dict[str, Any], chat: bool) -> list[int]:
        """The decision's exact count when no local tokenizer exists: an engine's /tokenize, a
        decoder's, then a prefiller's if that fails (a stalled decoder, ejected by the stall
        watch, would otherwise turn every long prompt asked meanwhile into a tokenize_error
        served whole, on no decoder)."""
        tried: list[Endpoint] = []
        for pool, load in (
            (self.decode, balancing.decode_load),
            (self.prefill, balancing.prefill_load),
        ):
            ep = balancing.pick([e for e in pool.healthy if e not in tried], load)
            if ep is None:
                continue
            tried.append(ep)
            try:
                return await self.legs.tokenize(ctx, ep, body, chat)
            except TokenizeError as exc:
                self.outcomes.upstream("decode", "tokenize")
                log.warning("tokenize failed: %s", exc, extra={"request_id": ctx.rid})
                error = exc
        if not tried:
            raise TokenizeError("no healthy engine to count the prompt")
        raise error


def _load_json(raw: bytes) -> Any:
    """A request body's JSON, or the 400 for one that is malformed or nests too deep."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return error_response(400, f"malformed JSON: {exc}", "invalid_request_error")
    if isinstance(body, dict | list) and too_deep(raw, body):
        msg = f"request JSON nests deeper than {MAX_JSON_DEPTH} levels (the router's limit)"
        return error_response(400, msg, "invalid_request_error")
    return body


def build_server(router: Router) -> HttpServer:
    """The router's routes on its HTTP server (``pd_router.http1``)."""
    routes = Routes()
    routes.add("GET", "/health", router.health)
    routes.add("GET", "/ready", router.ready)
    routes.add("GET", "/metrics", router.metrics_handler)
    routes.add("GET", "/v1/models", router.models)
    routes.add_prefix("GET", "/v1/models/", "model_id", router.model)  # ids may hold a "/"
    routes.add("POST", "/v1/chat/completions", router.chat)
    routes.add("POST", "/v1/completions", router.completions)
    for path in PASSTHROUGH_PATHS:
        routes.add("POST", path, router.passthrough)
    routes.fallback = router.not_found
    return HttpServer(
        routes,
        max_body=router.cfg.limits.max_body_bytes,
        max_headers=router.cfg.limits.max_headers,
        head_timeout=router.cfg.timeouts.client_header_seconds,
        idle_timeout=router.cfg.timeouts.client_idle_seconds,
        internal_error=lambda: error_response(500, "internal router error", "internal_error"),
    )
