"""HTTP surface of the router (aiohttp server on uvloop): routes, request id, auth, body read,
admission, validation, then the routing decision hands the request to its route.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` (alive), ``GET /ready`` (a healthy decoder exists), ``GET /metrics``.

A request's walk: ``app`` (admit -> read -> parse/validate) -> ``decide`` -> ``handoff.<route>``
-> ``legs`` -> ``upstream``; each module entered once, downward.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from pd_router import balancing, hub_tokenizer
from pd_router.admission import Admission, Reject
from pd_router.auth import ApiKeys
from pd_router.config import RouterConfig
from pd_router.decide import Decider
from pd_router.discovery import EndpointPool
from pd_router.failures import TokenizeError
from pd_router.handoff import DirectRoute, Route, build_route
from pd_router.handoff.lmcache_notify import KvWaiter, build_waiter
from pd_router.legs import Downstream, Legs
from pd_router.metrics import MULTIPROC_ENV, Metrics
from pd_router.openai_wire import (
    MAX_JSON_DEPTH,
    error_body,
    strip_handoff_fields,
    too_deep,
    validate,
)
from pd_router.request import Ctx, Outcomes
from pd_router.tokens import TokenCounter, tokenizer_from_json
from pd_router.upstream import UpstreamClient

log = logging.getLogger("pd_router")
_RID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # fullmatch: "$" would admit a trailing newline


def error_response(status: int, message: str, etype: str, headers: Any = None) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, etype),
        content_type="application/json",
        headers=headers,
    )


class Router:
    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = m = metrics or Metrics()

        def on_change(pool: EndpointPool) -> None:
            m.healthy.labels(pool.name).set(len(pool.healthy))
            m.endpoints.labels(pool.name).set(len(pool.endpoints))

        self.prefill = EndpointPool("prefill", cfg.pools.prefill, cfg.health, on_change)
        self.decode = EndpointPool("decode", cfg.pools.decode, cfg.health, on_change)
        self.keys = ApiKeys(cfg.auth.api_keys_file)
        self.metrics_tokens = ApiKeys(
            cfg.auth.metrics_tokens_file, field="auth.metricsTokensFile", env_var=""
        )
        if cfg.auth.protect_metrics and not (self.keys.enabled or self.metrics_tokens.enabled):
            log.warning(
                "auth.protectMetrics is on but no API key or metrics token is configured: "
                "/metrics is open"
            )
        self.counter = TokenCounter(cfg.model.tokenizer, cfg.model.served_name)
        self.admission = Admission(cfg.limits, m)
        self.outcomes = Outcomes(m)
        self.up = UpstreamClient(cfg.timeouts.connect_seconds)  # hot path
        self.legs = Legs(
            cfg.timeouts, self.up, self.prefill, self.decode, self.outcomes, cfg.model.served_name
        )
        self.decider = Decider(cfg.routing.threshold, self.counter)
        # The hand-off is chosen once, here (routing.connector).
        self.waiter: KvWaiter | None = None
        if cfg.routing.connector == "lmcache":
            m.preset_lmcache(cfg.lmcache.notification_receiver)
            self.waiter = build_waiter(cfg.lmcache, self.up, m)
        self.direct = DirectRoute(self.legs)
        self.disaggregated: Route = build_route(cfg, self.legs, self.direct, self.waiter)
        self.affinity_header = cfg.routing.session_affinity_header or None
        self.served = cfg.model.served_name
        self.session: aiohttp.ClientSession | None = None  # health checks
        self._bg: list[asyncio.Task[None]] = []

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
        for src in ("file", "hub"):
            m.tokenizer_loaded.labels(src).set(1 if self.counter.source == src else 0)
        if self.waiter is not None:  # first: a notification port already taken stops start-up
            await self.waiter.start()
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=None
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies: skip cookie work
        )
        await asyncio.gather(self.prefill.start(self.session), self.decode.start(self.session))
        loop = asyncio.get_running_loop()
        if self.cfg.auth.api_keys_file or self.cfg.auth.metrics_tokens_file:
            self._bg.append(loop.create_task(self._keys_loop()))
        if os.environ.get(MULTIPROC_ENV):  # one of several workers: see _load_gauges
            self._bg.append(loop.create_task(self._gauges_loop()))

    async def _keys_loop(self) -> None:
        while True:
            await asyncio.sleep(10)
            self.keys.maybe_reload()
            self.metrics_tokens.maybe_reload()

    def _load_gauges(self) -> None:
        """In-flight and outstanding counts, kept as gauges only when read: at a scrape, and
        every second in a worker (a scrape answered by another worker reads this one's)."""
        self.metrics.in_flight.set(self.admission.in_flight)
        for pool in (self.prefill, self.decode):
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
        await self.prefill.stop()
        await self.decode.stop()
        if self.waiter is not None:
            await self.waiter.stop()
        self.counter.close()
        self.up.close()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ auth
    def _authorized(self, request: web.Request) -> bool:
        return self.keys.check(request.headers.get("Authorization"))

    def _metrics_authorized(self, request: web.Request) -> bool:
        """/metrics under ``protectMetrics``: an API key or a metrics-only token."""
        if not self.cfg.auth.protect_metrics:
            return True
        if not (self.keys.enabled or self.metrics_tokens.enabled):
            return True  # no credential configured anywhere (warned at start-up)
        header = request.headers.get("Authorization")
        return self.keys.matches(header) or self.metrics_tokens.matches(header)

    # ------------------------------------------------------------------ simple routes
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def ready(self, request: web.Request) -> web.Response:
        if self.decode.healthy:
            return web.Response(body=b'{"status":"ready"}', content_type="application/json")
        return web.Response(
            status=503, body=b'{"status":"no healthy decoder"}', content_type="application/json"
        )

    async def metrics_handler(self, request: web.Request) -> web.Response:
        if not self._metrics_authorized(request):
            return error_response(
                401, "invalid or missing API key or metrics token", "authentication_error"
            )
        self._load_gauges()
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        data = {
            "object": "list",
            "data": [
                {"id": self.served, "object": "model", "created": 0, "owned_by": "pd-inference"}
            ],
        }
        return web.Response(body=orjson.dumps(data), content_type="application/json")

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"no route for {request.path}", "not_found_error")

    # ------------------------------------------------------------------ OpenAI requests
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, False)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id")
        if not rid or not _RID_RE.fullmatch(rid):
            rid = uuid.uuid4().hex
        ctx = Ctx(rid, chat, request.path)
        status = 0
        try:
            resp = await self._admit(request, ctx)
            status = resp.status
            if not resp.prepared:  # the router's own answers (errors) carry the id too
                resp.headers.setdefault("X-Request-Id", rid)
            return resp
        except asyncio.CancelledError:
            self.outcomes.disconnect(ctx)
            status = 499
            raise
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "request",
                    extra={
                        "request_id": rid,
                        "route": ctx.route,
                        "status": status,
                        "path": ctx.path,
                        "duration_ms": round((time.perf_counter() - ctx.t0) * 1000, 2),
                    },
                )

    async def _admit(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        """auth -> body -> a slot -> serve. The body is read before a slot is taken, under its
        own deadline: a client that stalls half-way through sending it must not hold one of
        maxInFlight."""
        out = self.outcomes
        if not self._authorized(request):
            out.count("none", "unauthorized")
            return error_response(401, "invalid or missing API key", "authentication_error")
        raw = await self._read_body(request)
        if isinstance(raw, web.Response):
            return raw
        try:
            await self.admission.acquire()
        except Reject as r:
            out.count("none", "rejected")
            return error_response(r.status, r.message, r.etype, {"Retry-After": r.retry_after})
        try:
            bad = self._parse(request, ctx, raw)
            if bad is not None:
                out.count("none", "bad_request")
                return bad
            return await self._route(request, ctx)
        finally:
            self.admission.release()

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        lim = self.cfg.limits
        count = self.outcomes.count
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # vLLM does not decode request bodies either
            count("none", "bad_request")
            msg = f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed"
            return error_response(415, msg, "invalid_request_error")
        if request.content_length is not None and request.content_length > lim.max_body_bytes:
            count("none", "too_large")
            return error_response(413, "request body too large", "invalid_request_error")
        try:
            async with asyncio.timeout(self.cfg.timeouts.client_body_seconds):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            count("none", "too_large")
            return error_response(413, "request body too large", "invalid_request_error")
        except TimeoutError:
            count("none", "body_timeout")
            msg = "the request body did not arrive within timeouts.clientBodySeconds"
            return error_response(408, msg, "invalid_request_error")
        except (HttpProcessingError, RequestPayloadError) as exc:  # a broken chunked body, etc.
            count("none", "bad_request")
            msg = f"unreadable request body: {getattr(exc, 'message', '') or exc}"
            return error_response(400, msg, "invalid_request_error")

    def _parse(self, request: web.Request, ctx: Ctx, raw: bytes) -> web.Response | None:
        """Fill ``ctx`` from the body, or the 400/404 answer for a body the router refuses."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"malformed JSON: {exc}", "invalid_request_error")
        if isinstance(body, dict | list) and too_deep(raw, body):
            msg = f"request JSON nests deeper than {MAX_JSON_DEPTH} levels (the router's limit)"
            return error_response(400, msg, "invalid_request_error")
        err = validate(body, ctx.chat)
        if err:
            return error_response(400, err, "invalid_request_error")
        model = body.get("model")
        if model is not None and model != self.served:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
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

    async def _route(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        """decide -> the chosen route."""
        d = await self.decider.decide(
            ctx.body, ctx.chat, functools.partial(self._engine_count, ctx)
        )
        self.outcomes.counted(d.source, d.tokens)
        if d.exact:
            ctx.ntok = d.tokens or 0
        ctx.ids = d.ids
        route = self.disaggregated if d.disaggregate else self.direct
        return await route.serve(ctx, Downstream(request))

    async def _engine_count(self, ctx: Ctx, body: dict[str, Any], chat: bool) -> list[int]:
        """The decision's exact count when no local tokenizer exists: an engine's /tokenize."""
        ep = balancing.pick(self.decode.healthy, balancing.decode_load) or balancing.pick(
            self.prefill.healthy, balancing.prefill_load
        )
        if ep is None:
            raise TokenizeError("no healthy engine to count the prompt")
        try:
            return await self.legs.tokenize(ctx, ep, body, chat)
        except TokenizeError as exc:
            self.outcomes.upstream("decode", "tokenize")
            log.warning("tokenize failed: %s", exc, extra={"request_id": ctx.rid})
            raise


def build_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=router.cfg.limits.max_body_bytes)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_handler)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_route("*", "/{tail:.*}", router.not_found)

    async def on_startup(_: web.Application) -> None:
        await router.start()

    async def on_cleanup(_: web.Application) -> None:
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
