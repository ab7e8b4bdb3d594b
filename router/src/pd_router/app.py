"""HTTP surface of the router (aiohttp server on uvloop; engine calls through the pooled
httptools client in ``upstream.py``, health checks through aiohttp's client).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` (alive), ``GET /ready`` (a healthy decoder exists), ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from pd_router import balancing, handoff_lmcache, handoff_nixl, hub_tokenizer, lengths
from pd_router.auth import ApiKeys
from pd_router.config import RouterConfig
from pd_router.discovery import Endpoint, EndpointPool
from pd_router.metrics import Metrics
from pd_router.tokens import (
    TokenCounter,
    prompt_text,
    template_allowance,
    token_ids_prompt,
    tokenizer_from_json,
)
from pd_router.upstream import Response, UpstreamClient

log = logging.getLogger("pd_router")
_RID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # fullmatch: "$" would admit a trailing newline
_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)

DIRECT = "direct"
DISAGG = "disaggregated"
FALLBACK = "fallback"

# Deepest JSON nesting a request may have. orjson reads 1024 levels but writes only 254, and
# the router re-serializes bodies, some inside its own wrapping (the hand-off legs), so a
# deeper body would end in a 500; 128 leaves room and is far beyond real requests.
MAX_JSON_DEPTH = 128


def error_response(status: int, message: str, etype: str, headers: Any = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


class Reject(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


class _ClientGone(Exception):
    """The client disconnected (or stopped reading) while we streamed to it."""


class _UpstreamFailed(Exception):
    """No decoder could serve the request before the first byte."""

    def __init__(self, status: int = 502, body: bytes | None = None, ctype: str = "") -> None:
        self.status = status
        self.body = body
        self.ctype = ctype


class Ctx:
    """Per-request state."""

    __slots__ = ("affinity", "chat", "headers", "ntok", "path", "rid", "route", "t0", "ttft_done")

    def __init__(self, rid: str, chat: bool, path: str, affinity: str | None) -> None:
        self.rid = rid
        self.chat = chat
        self.path = path
        self.affinity = affinity
        # pre-encoded upstream header block (rid is validated: no CR/LF possible)
        self.headers = b"Content-Type: application/json\r\nX-Request-Id: %s\r\n" % rid.encode()
        self.route = DIRECT
        self.t0 = time.perf_counter()
        self.ttft_done = False
        self.ntok = 0  # prompt tokens when counted exactly (tokens, tokenizer, /tokenize)


class _Hold:
    """One unit of an endpoint's ``active`` count, given back exactly once."""

    __slots__ = ("ep",)

    def __init__(self, ep: Endpoint) -> None:
        ep.active += 1
        self.ep: Endpoint | None = ep

    def release(self) -> None:
        if self.ep is not None:
            self.ep.active -= 1
            self.ep = None


def validate(body: Any, chat: bool) -> str | None:
    """Return an error message for bodies the router must refuse (400), else None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "'model' must be a string"
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty array"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a string 'role'"
            c = m.get("content")
            if (c is not None and not isinstance(c, str)) and (
                not isinstance(c, list) or not all(isinstance(p, dict) for p in c)
            ):
                return f"messages[{i}].content must be a string or an array of parts"
    else:
        p = body.get("prompt")
        ok = isinstance(p, str) or (
            isinstance(p, list)
            and p
            and (
                all(isinstance(x, str) for x in p)
                or all(type(x) is int for x in p)
                or all(isinstance(x, list) and all(type(t) is int for t in x) for x in p)
            )
        )
        if not ok:
            return "'prompt' must be a string, an array of strings or an array of token ids"
    for key in ("stream", "ignore_eos", "echo"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            return f"'{key}' must be a boolean"
    for key in ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens"):
        v = body.get(key)
        if v is not None and (type(v) is not int):
            return f"'{key}' must be an integer"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and v < 1:
            return f"'{key}' must be >= 1"
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            return f"'{key}' must be a number"
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return "'stream_options' must be an object"
    return None


def too_deep(raw: bytes, body: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if ``body`` (parsed from ``raw``) nests containers deeper than ``limit``."""
    # every container opens with a [ or { byte, so this few cannot nest deeper (C-speed count)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:  # iterative: the depth is what is being checked
        v, depth = todo.pop()
        children = v.values() if isinstance(v, dict) else v
        for c in children:
            if isinstance(c, dict | list):
                if depth >= limit:
                    return True
                todo.append((c, depth + 1))
    return False


def strip_handoff_fields(body: dict[str, Any]) -> bool:
    """Remove what a client sent to steer the KV hand-off (it belongs to the router alone):
    top-level ``kv_transfer_params`` and ``vllm_xargs.kv_transfer_params`` (vLLM merges
    ``vllm_xargs`` into ``SamplingParams.extra_args``, where its connectors read
    ``kv_transfer_params``; checked against vLLM's ``to_sampling_params``). True if changed."""
    changed = "kv_transfer_params" in body
    body.pop("kv_transfer_params", None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
        changed = True
    return changed


async def _error_detail(resp: Response, limit: int = 4096) -> tuple[str, str]:
    """(type, message) of an engine's OpenAI-format error answer, from at most its first
    ``limit`` bytes (read under the response's idle timeout); ("", "") when unreadable. The
    response is released (closed unless read to its end)."""
    buf = b""
    try:
        async with contextlib.aclosing(resp.iter_any()) as chunks:
            async for chunk in chunks:
                buf += chunk
                if len(buf) >= limit:
                    break
    except _UPSTREAM_ERRORS:
        pass
    finally:
        resp.release()
    try:
        d = orjson.loads(buf)
        err = d.get("error", d) if isinstance(d, dict) else None  # older vLLM: top level
        msg = err.get("message") if isinstance(err, dict) else None
        etype = err.get("type") if isinstance(err, dict) else None
    except orjson.JSONDecodeError:
        return "", ""
    return (etype if isinstance(etype, str) else ""), (msg if isinstance(msg, str) else "")


def _is_batch(prompt: list[Any]) -> bool:
    """A list of strings or of token lists with more than one entry (not one token list)."""
    return len(prompt) > 1 and not all(type(t) is int for t in prompt)


class Router:
    def __init__(self, cfg: RouterConfig, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        m = self.metrics

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
        self.lmcache = cfg.routing.connector == "lmcache"
        # notificationReceiver router: this process binds the ZMQ PULL socket (one replica);
        # prefillSidecar: the prefill pod's sidecar is asked (no socket, replicas scale)
        self.sidecar = cfg.lmcache.notification_receiver == "prefillSidecar"
        if self.lmcache:
            self.metrics.preset_lmcache(cfg.lmcache.notification_receiver)
        self.listener: handoff_lmcache.NotifyListener | None = None
        self.session: aiohttp.ClientSession | None = None  # health checks, /tokenize
        self.up = UpstreamClient(cfg.timeouts.connect_seconds)  # hot path
        t = cfg.timeouts
        self.t_tokenize = min(30.0, t.first_byte_seconds)
        # a streaming client that accepts nothing for this long is dropped
        self._stall = 2 * t.stream_idle_seconds
        self.in_flight = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.threshold = cfg.routing.threshold
        self.affinity_header = cfg.routing.session_affinity_header or None
        self.served = cfg.model.served_name
        self._bg: list[asyncio.Task[None]] = []
        self._req_counters: dict[tuple[str, str], Any] = {}
        self._route_hist: dict[str, tuple[Any, Any, Any]] = {}
        self._src = {
            src: m.token_count_source.labels(src)
            for src in ("skipped", "tokens", "bound", "tokenizer", "engine", "estimate")
        }
        self._hw = {c: m.handoff_wait.labels(c) for c in ("nixl", "lmcache")}
        for route in (DIRECT, DISAGG, FALLBACK):
            self._route_hist[route] = (
                m.ttft.labels(route),
                m.itl.labels(route),
                m.e2e.labels(route),
            )

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
        if self.lmcache and not self.sidecar:  # first: a port already taken stops start-up
            lm = self.cfg.lmcache
            self.listener = handoff_lmcache.NotifyListener(
                lm.notify_bind_host, lm.notify_port, lm.notifications_per_request, self.metrics
            )
            await self.listener.start()
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
        if self.cfg.auth.api_keys_file or self.cfg.auth.metrics_tokens_file:
            self._bg.append(asyncio.get_running_loop().create_task(self._keys_loop()))

    async def _keys_loop(self) -> None:
        while True:
            await asyncio.sleep(10)
            self.keys.maybe_reload()
            self.metrics_tokens.maybe_reload()

    async def stop(self) -> None:
        for t in self._bg:
            t.cancel()
        await self.prefill.stop()
        await self.decode.stop()
        if self.listener is not None:
            await self.listener.stop()
        self.up.close()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ small helpers
    def _count(self, route: str, outcome: str) -> None:
        c = self._req_counters.get((route, outcome))
        if c is None:
            c = self._req_counters[(route, outcome)] = self.metrics.requests.labels(route, outcome)
        c.inc()

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

    async def _acquire(self) -> None:
        lim = self.cfg.limits
        if self.in_flight < lim.max_in_flight and not self.waiters:
            self.in_flight += 1
            return
        if len(self.waiters) >= lim.max_queued:
            self.metrics.rejected.labels("queue_full").inc()
            raise Reject(
                error_response(
                    429,
                    "router queue is full, retry later",
                    "rate_limit_error",
                    {"Retry-After": "1"},
                )
            )
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
            raise Reject(
                error_response(
                    503,
                    "router overloaded: queue wait timed out",
                    "service_unavailable",
                    {"Retry-After": "2"},
                )
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()
            fut.cancel()
            raise
        finally:
            try:
                self.waiters.remove(fut)
            except ValueError:
                pass
            self.metrics.queued.set(len(self.waiters))

    def _release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; in_flight unchanged
                return
        self.in_flight -= 1

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
        self.metrics.in_flight.set(self.in_flight)
        for pool in (self.prefill, self.decode):
            self.metrics.outstanding.labels(pool.name).set(
                sum(e.active for e in pool.endpoints.values())
            )
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

    # ------------------------------------------------------------------ main entry
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, False)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id")
        if not rid or not _RID_RE.fullmatch(rid):
            rid = uuid.uuid4().hex
        ctx = Ctx(rid, chat, request.path, None)
        status = 0
        try:
            resp = await self._admit_and_serve(request, ctx)
            status = resp.status
            if not resp.prepared:  # the router's own answers (errors) carry the id too
                resp.headers.setdefault("X-Request-Id", rid)
            return resp
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            self._count(ctx.route, "client_disconnect")
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

    async def _admit_and_serve(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        if not self._authorized(request):
            self._count("none", "unauthorized")
            return error_response(401, "invalid or missing API key", "authentication_error")
        # The body is read before a slot is taken, under its own deadline: a client that
        # stalls half-way through sending it must not hold one of maxInFlight.
        raw = await self._read_body(request)
        if isinstance(raw, web.Response):
            return raw
        try:
            await self._acquire()
        except Reject as r:
            self._count("none", "rejected")
            return r.response
        try:
            return await self._serve(request, ctx, raw)
        finally:
            self._release()

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        lim = self.cfg.limits
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # vLLM does not decode request bodies either
            self._count("none", "bad_request")
            msg = f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed"
            return error_response(415, msg, "invalid_request_error")
        if request.content_length is not None and request.content_length > lim.max_body_bytes:
            self._count("none", "too_large")
            return error_response(413, "request body too large", "invalid_request_error")
        try:
            async with asyncio.timeout(self.cfg.timeouts.client_body_seconds):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count("none", "too_large")
            return error_response(413, "request body too large", "invalid_request_error")
        except TimeoutError:
            self._count("none", "body_timeout")
            msg = "the request body did not arrive within timeouts.clientBodySeconds"
            return error_response(408, msg, "invalid_request_error")
        except (HttpProcessingError, RequestPayloadError) as exc:  # a broken chunked body, etc.
            self._count("none", "bad_request")
            msg = f"unreadable request body: {getattr(exc, 'message', '') or exc}"
            return error_response(400, msg, "invalid_request_error")

    async def _serve(self, request: web.Request, ctx: Ctx, raw: bytes) -> web.StreamResponse:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._count("none", "bad_request")
            return error_response(400, f"malformed JSON: {exc}", "invalid_request_error")
        if isinstance(body, dict | list) and too_deep(raw, body):
            self._count("none", "bad_request")
            msg = f"request JSON nests deeper than {MAX_JSON_DEPTH} levels (the router's limit)"
            return error_response(400, msg, "invalid_request_error")
        err = validate(body, ctx.chat)
        if err:
            self._count("none", "bad_request")
            return error_response(400, err, "invalid_request_error")
        model = body.get("model")
        if model is not None and model != self.served:
            self._count("none", "bad_request")
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
        if strip_handoff_fields(body):
            raw = orjson.dumps(body)
        if self.affinity_header:
            ctx.affinity = request.headers.get(self.affinity_header) or None
        if self.cfg.logging.log_prompts:
            log.info("prompt", extra={"request_id": ctx.rid, "body": body})
        disagg, ids = await self._decide(body, ctx)
        if not disagg:
            ctx.route = DIRECT
            return await self._direct(request, ctx, raw, body)
        if self.lmcache:
            return await self._lmcache(request, ctx, raw, body, ids)
        # prefiller load: the exact prompt length when it was counted, else bytes / 4
        return await self._nixl(request, ctx, raw, body, ctx.ntok or len(raw) // 4)

    # ------------------------------------------------------------------ decision
    async def _decide(self, body: dict[str, Any], ctx: Ctx) -> tuple[bool, list[int] | None]:
        m = self.metrics
        th = self.threshold
        chat = ctx.chat
        n = body.get("n")
        if (n is not None and n != 1) or (
            not chat and isinstance(body.get("prompt"), list) and _is_batch(body["prompt"])
        ):
            self._src["skipped"].inc()
            return False, None  # batched prompts and n > 1 are served directly
        if th == 0:
            self._src["skipped"].inc()
            return True, None
        ids = token_ids_prompt(body) if not chat else None
        if ids is not None:
            self._src["tokens"].inc()
            m.prompt_tokens.observe(len(ids))
            ctx.ntok = len(ids)
            return len(ids) >= th, ids
        text = prompt_text(body, chat)
        allowance = template_allowance(body, chat)
        nbytes = len(text.encode("utf-8", "surrogatepass")) + allowance
        if nbytes < th:
            self._src["bound"].inc()
            m.prompt_tokens.observe(max(1, nbytes // 4))
            return False, None
        if self.counter.local is not None:
            n = self.counter.local_count(text, allowance)
            self._src["tokenizer"].inc()
            m.prompt_tokens.observe(n)
            ctx.ntok = n
            return n >= th, None
        ep = balancing.pick(self.decode.healthy, balancing.decode_load) or balancing.pick(
            self.prefill.healthy, balancing.prefill_load
        )
        if ep is not None:
            assert self.session is not None
            try:
                ids = await self.counter.engine_tokenize(
                    self.up, ep, body, chat, self.t_tokenize, ctx.headers
                )
                self._src["engine"].inc()
                m.prompt_tokens.observe(len(ids))
                ctx.ntok = len(ids)
                return len(ids) >= th, ids
            except (*_UPSTREAM_ERRORS, RuntimeError, ValueError, KeyError, TypeError) as exc:
                m.upstream_errors.labels("decode", "tokenize").inc()
                log.warning("tokenize failed: %s", exc, extra={"request_id": ctx.rid})
        est = max(1, nbytes // 4)
        self._src["estimate"].inc()
        m.prompt_tokens.observe(est)
        return est >= th, None

    # ------------------------------------------------------------------ direct leg(s)
    async def _open_decoder(
        self,
        ctx: Ctx,
        path: str,
        data: bytes,
        stream: bool,
        exclude: list[Endpoint] | None = None,
        retry_data: bytes | None = None,
    ) -> tuple[Response, Endpoint]:
        """Open a response on a decoder, retrying other decoders on failures before the first
        byte (connect error, timeout, 5xx). Upstream 4xx is returned as is. ``retry_data``:
        the body retries send instead of ``data`` (the route becomes ``fallback``)."""
        tried: list[Endpoint] = list(exclude or [])
        pool = self.decode
        m = self.metrics
        last: _UpstreamFailed | None = None
        attempts = 0
        t = self.cfg.timeouts
        idle = t.stream_idle_seconds if stream else t.first_byte_seconds
        while True:
            ep = balancing.pick(pool.healthy, balancing.decode_load, ctx.affinity, tried)
            if ep is None and exclude and not tried[len(exclude) :]:
                # only the excluded decoder is healthy: better it than nothing
                ep = balancing.pick(pool.healthy, balancing.decode_load, ctx.affinity)
                exclude = None
            if ep is None:
                raise last or _UpstreamFailed(503, None)
            if attempts:
                m.retries.labels("decode").inc()
                if retry_data is not None and data is not retry_data:
                    data = retry_data
                    m.fallbacks.labels("decode_retry").inc()
                    ctx.route = FALLBACK
            attempts += 1
            tried.append(ep)
            ep.active += 1
            started = time.monotonic()
            try:
                resp = await self.up.post(
                    ep.host, ep.port, ep.tls, path, data, ctx.headers, t.first_byte_seconds, idle
                )
            except _UPSTREAM_ERRORS as exc:
                ep.active -= 1
                pool.report_failure(ep)
                kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                m.upstream_errors.labels("decode", kind).inc()
                log.warning("decoder %s failed: %r", ep.base, exc, extra={"request_id": ctx.rid})
                last = _UpstreamFailed(504 if kind == "timeout" else 502)
                continue
            except BaseException:
                ep.active -= 1
                raise
            if resp.status >= 500:
                try:
                    body = await resp.read_release()
                except _UPSTREAM_ERRORS:
                    body = b""
                ep.active -= 1
                pool.report_failure(ep)
                m.upstream_errors.labels("decode", "5xx").inc()
                last = _UpstreamFailed(resp.status, body, resp.headers.get("content-type", ""))
                continue
            if stream and resp.status == 200:
                failed = await self._first_data_failed(ctx, resp, ep, started)
                if failed is not None:
                    last = failed
                    continue
            pool.report_success(ep)
            return resp, ep

    async def _first_data_failed(
        self, ctx: Ctx, resp: Response, ep: Endpoint, started: float
    ) -> _UpstreamFailed | None:
        """A stream is only handed to the client once its first bytes arrived (vLLM sends
        the headers at once and the first chunk with the first token), so a decoder that
        accepts a stream and then dies or stalls for ``firstByteSeconds`` is still retried.
        On failure the response is closed (the engine aborts it) and counted."""
        try:  # firstByteSeconds counts from the request, headers included
            left = self.cfg.timeouts.first_byte_seconds - (time.monotonic() - started)
            await resp.first_data(max(0.0, left))
            return None
        except _UPSTREAM_ERRORS as exc:
            ep.active -= 1
            resp.close()
            self.decode.report_failure(ep)
            kind = "timeout" if isinstance(exc, TimeoutError) else "stream"
            self.metrics.upstream_errors.labels("decode", kind).inc()
            log.warning(
                "decoder %s failed before its first chunk: %r",
                ep.base,
                exc,
                extra={"request_id": ctx.rid},
            )
            return _UpstreamFailed(504 if kind == "timeout" else 502)
        except BaseException:
            ep.active -= 1
            resp.close()
            raise

    def _fail_response(self, ctx: Ctx, exc: _UpstreamFailed) -> web.Response:
        self._count(ctx.route, "upstream_error")
        hdrs = {"x-pd-route": ctx.route, "x-request-id": ctx.rid}
        if exc.body is not None and exc.ctype.startswith("application/json"):
            return web.Response(
                status=exc.status, body=exc.body, content_type="application/json", headers=hdrs
            )
        msg = {
            503: "no healthy decoder available",
            504: "upstream timed out",
        }.get(exc.status, "upstream engine failed")
        if exc.status == 503:
            hdrs["Retry-After"] = "2"
        return error_response(exc.status, msg, "upstream_error", hdrs)

    async def _direct(
        self,
        request: web.Request,
        ctx: Ctx,
        data: bytes,
        body: dict[str, Any],
        retry_data: bytes | None = None,
    ) -> web.StreamResponse:
        stream = body.get("stream") is True
        try:
            resp, ep = await self._open_decoder(ctx, ctx.path, data, stream, retry_data=retry_data)
        except _UpstreamFailed as exc:
            return self._fail_response(ctx, exc)
        return await self._relay(request, ctx, resp, ep, stream)

    async def _relay(
        self,
        request: web.Request,
        ctx: Ctx,
        resp: Response,
        ep: Endpoint,
        stream: bool,
    ) -> web.StreamResponse:
        """Forward an upstream response (bytes as they come, no re-encoding)."""
        hdrs = {
            "x-pd-route": ctx.route,
            "x-request-id": ctx.rid,
            "Content-Type": resp.headers.get("content-type", "application/json"),
        }
        if stream and resp.status == 200:
            hdrs["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=200, headers=hdrs)
            try:
                await out.prepare(request)
            except BaseException:
                ep.active -= 1
                resp.close()  # client went away: close so the engine aborts the request
                raise
            return await self._pump(ctx, out, resp, ep, None)
        try:
            data = await resp.read_release()  # closed on failure or client disconnect
        except _UPSTREAM_ERRORS as exc:
            kind = "timeout" if isinstance(exc, TimeoutError) else "stream"
            self.metrics.upstream_errors.labels("decode", kind).inc()
            self.decode.report_failure(ep)
            return self._fail_response(ctx, _UpstreamFailed(504 if kind == "timeout" else 502))
        finally:
            ep.active -= 1
        if resp.status == 200:
            ttft_h, _, e2e_h = self._route_hist[ctx.route]
            now = time.perf_counter()
            ttft_h.observe(now - ctx.t0)
            e2e_h.observe(now - ctx.t0)
        self._count(ctx.route, "ok" if resp.status < 400 else "client_error")
        return web.Response(status=resp.status, body=data, headers=hdrs)

    async def _pump(
        self,
        ctx: Ctx,
        out: web.StreamResponse,
        resp: Response,
        ep: Endpoint,
        relabel: Any,
    ) -> web.StreamResponse:
        """Forward a decoder's SSE body to the client as it arrives: bytes as they are, or
        through ``relabel(chunk) -> bytes``. Owns ``resp`` and the endpoint's active count."""
        ttft_h, itl_h, e2e_h = self._route_hist[ctx.route]
        ok = False
        last = time.perf_counter() if ctx.ttft_done else 0.0
        loop = asyncio.get_running_loop()
        stall = self._stall
        guard = None
        try:
            try:
                # guard: a client that stops reading must not hold the stream forever
                async with asyncio.timeout(stall) as guard:
                    async for chunk in resp.iter_any():
                        now = time.perf_counter()
                        if last:
                            itl_h.observe(now - last)
                        else:
                            ttft_h.observe(now - ctx.t0)
                        last = now
                        data = chunk if relabel is None else relabel(chunk)
                        if data:
                            try:
                                await out.write(data)
                            except ConnectionError:
                                raise _ClientGone from None
                        guard.reschedule(loop.time() + stall)
            except _ClientGone:
                return self._client_gone(ctx, out)
            except _UPSTREAM_ERRORS:
                if guard is not None and guard.expired():
                    return self._client_gone(ctx, out)
                self.metrics.upstream_errors.labels("decode", "stream").inc()
                self.decode.report_failure(ep)
                await self._stream_error(out, "upstream stream failed")
                self._count(ctx.route, "upstream_error")
                ok = True
                return out
            await out.write_eof()
            e2e_h.observe(time.perf_counter() - ctx.t0)
            self._count(ctx.route, "ok")
            ok = True
            return out
        finally:
            ep.active -= 1
            if ok:
                resp.release()
            else:
                resp.close()  # client went away: close so the engine aborts the request

    def _client_gone(self, ctx: Ctx, out: web.StreamResponse) -> web.StreamResponse:
        """Count a client that went away mid-stream; the caller closes the upstream."""
        self.metrics.client_disconnects.inc()
        self._count(ctx.route, "client_disconnect")
        return out

    async def _stream_error(
        self, out: web.StreamResponse, msg: str, etype: str = "upstream_error", code: int = 502
    ) -> None:
        err = {"error": {"message": msg, "type": etype, "param": None, "code": code}}
        try:
            await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    # ------------------------------------------------------------------ prefill leg
    async def _prefill(
        self, ctx: Ctx, ep: Endpoint, path: str, body: dict[str, Any], ntok: int
    ) -> tuple[int, Any, bytes]:
        """Run a non-streaming prefill request. Returns (status, parsed json or None, raw)."""
        ep.active += 1
        ep.queued_tokens += ntok
        ps = self.cfg.timeouts.prefill_seconds
        try:
            # headers within prefillSeconds, then no gap longer than prefillSeconds
            r = await self.up.post(
                ep.host, ep.port, ep.tls, path, orjson.dumps(body), ctx.headers, ps, ps
            )
            raw = await r.read_release()
            status = r.status
        finally:
            ep.active -= 1
            ep.queued_tokens -= ntok
        if status != 200:
            return status, None, raw
        try:
            return status, orjson.loads(raw), raw
        except orjson.JSONDecodeError:
            return 502, None, raw

    async def _fallback(
        self, request: web.Request, ctx: Ctx, raw: bytes, body: dict[str, Any], reason: str
    ) -> web.StreamResponse:
        self.metrics.fallbacks.labels(reason).inc()
        ctx.route = FALLBACK
        return await self._direct(request, ctx, raw, body)

    def _prefill_failed(self, ep: Endpoint, exc: BaseException | None, status: int) -> str:
        m = self.metrics
        if isinstance(exc, TimeoutError):
            kind = "timeout"
        elif exc is not None:
            kind = "connect"
        else:
            kind = "5xx" if status >= 500 else "bad_response"
        m.upstream_errors.labels("prefill", kind).inc()
        self.prefill.report_failure(ep)
        return "prefill_timeout" if kind == "timeout" else "prefill_error"

    def _passthrough(self, ctx: Ctx, status: int, raw: bytes) -> web.Response:
        self._count(ctx.route, "client_error")
        return web.Response(
            status=status,
            body=raw,
            content_type="application/json",
            headers={"x-pd-route": ctx.route, "x-request-id": ctx.rid},
        )

    # ------------------------------------------------------------------ NIXL
    async def _nixl(
        self, request: web.Request, ctx: Ctx, raw: bytes, body: dict[str, Any], ntok: int
    ) -> web.StreamResponse:
        if lengths.min_tokens_above(body, lengths.requested_max_tokens(body, ctx.chat)):
            # invalid as sent (vLLM answers 400): no prefill for it
            return await self._fallback(request, ctx, raw, body, "unsupported_fields")
        ep = balancing.pick(self.prefill.healthy, balancing.prefill_load)
        if ep is None:
            return await self._fallback(request, ctx, raw, body, "no_prefiller")
        ctx.route = DISAGG
        t0 = time.perf_counter()
        try:
            status, resp, praw = await self._prefill(
                ctx, ep, ctx.path, handoff_nixl.prefill_body(body), ntok
            )
        except _UPSTREAM_ERRORS as exc:
            return await self._fallback(request, ctx, raw, body, self._prefill_failed(ep, exc, 0))
        if 400 <= status < 500:
            return self._passthrough(ctx, status, praw)
        if status != 200:
            return await self._fallback(
                request, ctx, raw, body, self._prefill_failed(ep, None, status)
            )
        self.prefill.report_success(ep)
        kvp = handoff_nixl.decode_params(resp)
        if kvp is None:
            self.metrics.upstream_errors.labels("prefill", "no_kv_params").inc()
            return await self._fallback(request, ctx, raw, body, "no_kv_params")
        self._hw["nixl"].observe(time.perf_counter() - t0)
        data = orjson.dumps(handoff_nixl.decode_body(body, kvp))
        # A retry goes out without the hand-off: the failed decoder may already have pulled
        # the blocks, and the prefiller frees them once pulled (vLLM v0.11 NixlConnector), so
        # the next decoder recomputes the prompt instead of reading blocks that may be reused.
        return await self._direct(request, ctx, data, body, retry_data=raw)

    # ------------------------------------------------------------------ LMCache
    async def _lmcache(
        self,
        request: web.Request,
        ctx: Ctx,
        raw: bytes,
        body: dict[str, Any],
        ids: list[int] | None,
    ) -> web.StreamResponse:
        assert self.session is not None
        listener = self.listener
        assert listener is not None or self.sidecar
        m = self.metrics
        chat = ctx.chat
        if chat and not handoff_lmcache.chat_supported(body):
            return await self._fallback(request, ctx, raw, body, "unsupported_fields")
        if not chat and not handoff_lmcache.completions_supported(body):
            return await self._fallback(request, ctx, raw, body, "unsupported_fields")
        pre = balancing.pick(self.prefill.healthy, balancing.prefill_load)
        if pre is None:
            return await self._fallback(request, ctx, raw, body, "no_prefiller")
        dec = balancing.pick(self.decode.healthy, balancing.decode_load, ctx.affinity)
        if dec is None:
            return self._fail_response(ctx, _UpstreamFailed(503))
        if ids is None:
            try:
                ids = await self.counter.engine_tokenize(
                    self.up, pre, body, chat, self.t_tokenize, ctx.headers
                )
            except (*_UPSTREAM_ERRORS, RuntimeError, ValueError, KeyError, TypeError):
                m.upstream_errors.labels("prefill", "tokenize").inc()
                return await self._fallback(request, ctx, raw, body, "tokenize_error")
        mt = lengths.effective_max_tokens(body, chat, len(ids), self.counter.max_model_len)
        if mt is None:
            return await self._fallback(request, ctx, raw, body, "unknown_max_tokens")
        if lengths.min_tokens_above(body, mt):
            # invalid as sent: a decoder answers it exactly as vLLM does (400), unsplit
            return await self._fallback(request, ctx, raw, body, "unsupported_fields")
        mml = self.counter.max_model_len
        if mml is not None and len(ids) + mt > mml:
            # vLLM 0.31 refuses prompt + max_tokens above the context (400) but would accept the
            # 1-token prefill leg: unsplit, the client gets the decoder's own answer, never a 200
            # and one token before the error (0.33 clamps max_tokens and serves it)
            return await self._fallback(request, ctx, raw, body, "too_long")
        ctx.route = DISAGG
        lm = self.cfg.lmcache
        req_id = f"{ctx.rid}-{uuid.uuid4().hex[:8]}"
        # Held while its KV arrives, so concurrent long prompts spread over decoders.
        hold = _Hold(dec)
        fut = listener.expect(req_id) if listener is not None else None
        try:
            t0 = time.perf_counter()
            pbody = handoff_lmcache.prefill_body(
                body, ids, req_id, dec.host, lm.decoder_init_ports, lm.decoder_alloc_ports
            )
            try:
                status, presp, praw = await self._prefill(
                    ctx, pre, "/v1/completions", pbody, len(ids)
                )
            except _UPSTREAM_ERRORS as exc:
                if listener is not None:
                    listener.cancel(req_id)
                hold.release()  # not waiting for a KV any more
                return await self._fallback(
                    request, ctx, raw, body, self._prefill_failed(pre, exc, 0)
                )
            first_tok = None
            first_text = ""
            finish = None
            if status == 200:
                try:
                    first_tok = presp["kv_transfer_params"]["first_tok"]
                    ch = presp["choices"][0]
                    first_text = ch.get("text") or ""
                    finish = ch.get("finish_reason")
                except (KeyError, TypeError, IndexError):
                    first_tok = None
            if 400 <= status < 500:
                return self._passthrough(ctx, status, praw)
            if status != 200 or type(first_tok) is not int:
                if listener is not None:
                    listener.cancel(req_id)
                hold.release()  # not waiting for a KV any more
                return await self._fallback(
                    request, ctx, raw, body, self._prefill_failed(pre, None, status or 502)
                )
            # the prefiller's success is reported once its hand-off completed (below): reported
            # here, it would reset the failures a missing notification counts every time
            stream = body.get("stream") is True
            done_after_first = finish == "stop" or mt == 1
            sid = ("chatcmpl-" if chat else "cmpl-") + ctx.rid
            created = int(time.time())
            out: web.StreamResponse | None = None
            if stream:
                hdrs = {
                    "x-pd-route": DISAGG,
                    "x-request-id": ctx.rid,
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                }
                out = web.StreamResponse(status=200, headers=hdrs)
                first = self._first_chunk(chat, sid, created, first_text, finish, done_after_first)
                try:
                    await out.prepare(request)
                    await out.write(b"data: " + orjson.dumps(first) + b"\n\n")
                except ConnectionError:
                    return self._client_gone(ctx, out)
                self._route_hist[DISAGG][0].observe(time.perf_counter() - ctx.t0)
                ctx.ttft_done = True
            if done_after_first:
                self.prefill.report_success(pre)
                if listener is not None:
                    listener.cancel(req_id)
                return await self._lmcache_first_only(
                    ctx, out, chat, sid, created, first_text, finish, len(ids), body
                )
            kind = "notify_timeout"
            if listener is not None:
                assert fut is not None
                ok = await listener.wait(req_id, fut, lm.notify_timeout_seconds)
            else:
                outcome = await handoff_lmcache.sidecar_wait(
                    self.session,
                    pre.host,
                    lm.sidecar_port,
                    req_id,
                    lm.notifications_per_request,
                    lm.notify_timeout_seconds,
                    self.cfg.timeouts.connect_seconds,
                )
                m.sidecar_waits.labels(outcome).inc()
                ok = outcome == "ok"
                if outcome == "error":
                    kind = "sidecar_error"
            self._hw["lmcache"].observe(time.perf_counter() - t0)
            exclude: list[Endpoint] = []
            if ok:
                self.prefill.report_success(pre)
            else:
                # a broken hand-off counts against the prefiller like a failed prefill: after
                # passiveFailureThreshold in a row it is ejected until an active check passes
                m.upstream_errors.labels("prefill", kind).inc()
                self.prefill.report_failure(pre)
                m.fallbacks.labels("notify_timeout").inc()
                log.warning("LMCache notification timed out", extra={"request_id": ctx.rid})
                ctx.route = FALLBACK
                exclude = [dec]  # its buffer may hold a partial KV: decode elsewhere if possible
            dbody = handoff_lmcache.decode_body(body, ids, first_tok, mt, stream)
            data = orjson.dumps(dbody)
            hold.release()  # the decode leg counts itself from here on
            try:
                if ok:
                    resp, dep = await self._open_pinned(ctx, dec, data, stream)
                else:
                    resp, dep = await self._open_decoder(
                        ctx, "/v1/completions", data, stream, exclude
                    )
            except _UpstreamFailed as exc:
                if out is None:
                    return self._fail_response(ctx, exc)
                await self._stream_error(out, "no decoder could continue the stream")
                self._count(ctx.route, "upstream_error")
                return out
            if resp.status != 200 and out is not None:
                try:
                    etype, emsg = await _error_detail(resp)
                finally:
                    dep.active -= 1
                msg = f"decoder answered {resp.status}" + (f": {emsg}" if emsg else "")
                await self._stream_error(out, msg, etype or "upstream_error", resp.status)
                self._count(ctx.route, "upstream_error")
                return out
            if out is None:
                return await self._lmcache_full(ctx, resp, dep, chat, sid, first_text)
            return await self._lmcache_stream(ctx, out, resp, dep, chat, sid)
        finally:  # whatever happened: the decoder and the notification waiter are given up
            hold.release()
            if listener is not None:
                listener.cancel(req_id)

    async def _open_pinned(
        self, ctx: Ctx, dec: Endpoint, data: bytes, stream: bool
    ) -> tuple[Response, Endpoint]:
        """Decode leg on the decoder that received the KV; other decoders if it fails."""
        t = self.cfg.timeouts
        dec.active += 1
        started = time.monotonic()
        try:
            resp = await self.up.post(
                dec.host,
                dec.port,
                dec.tls,
                "/v1/completions",
                data,
                ctx.headers,
                t.first_byte_seconds,
                t.stream_idle_seconds if stream else t.first_byte_seconds,
            )
        except _UPSTREAM_ERRORS:
            dec.active -= 1
            self.decode.report_failure(dec)
            self.metrics.upstream_errors.labels("decode", "connect").inc()
            self.metrics.retries.labels("decode").inc()
            return await self._open_decoder(ctx, "/v1/completions", data, stream, [dec])
        except BaseException:
            dec.active -= 1
            raise
        if resp.status >= 500:
            resp.close()
            dec.active -= 1
            self.decode.report_failure(dec)
            self.metrics.upstream_errors.labels("decode", "5xx").inc()
            self.metrics.retries.labels("decode").inc()
            return await self._open_decoder(ctx, "/v1/completions", data, stream, [dec])
        if stream and resp.status == 200 and await self._first_data_failed(ctx, resp, dec, started):
            self.metrics.retries.labels("decode").inc()
            return await self._open_decoder(ctx, "/v1/completions", data, stream, [dec])
        self.decode.report_success(dec)
        return resp, dec

    def _first_chunk(
        self, chat: bool, sid: str, created: int, text: str, finish: Any, last: bool
    ) -> dict[str, Any]:
        return self._answer(chat, sid, created, text, (finish or "length") if last else None)

    async def _lmcache_first_only(
        self,
        ctx: Ctx,
        out: web.StreamResponse | None,
        chat: bool,
        sid: str,
        created: int,
        text: str,
        finish: Any,
        n_prompt: int,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        e2e = self._route_hist[DISAGG][2]
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 1, "total_tokens": n_prompt + 1}
        if out is not None:
            tail = b"data: [DONE]\n\n"
            so = body.get("stream_options")
            if isinstance(so, dict) and so.get("include_usage"):  # as vLLM: a last usage chunk
                obj = "chat.completion.chunk" if chat else "text_completion"
                last = {"id": sid, "object": obj, "created": created, "model": self.served}
                last.update(choices=[], usage=usage)
                tail = b"data: " + orjson.dumps(last) + b"\n\n" + tail
            try:
                await out.write(tail)
                await out.write_eof()
            except ConnectionError:
                return self._client_gone(ctx, out)
            e2e.observe(time.perf_counter() - ctx.t0)
            self._count(ctx.route, "ok")
            return out
        resp = self._full_body(chat, sid, created, text, finish or "length", usage)
        e2e.observe(time.perf_counter() - ctx.t0)
        self._count(ctx.route, "ok")
        return web.Response(
            body=orjson.dumps(resp),
            content_type="application/json",
            headers={"x-pd-route": ctx.route, "x-request-id": ctx.rid},
        )

    def _full_body(
        self, chat: bool, sid: str, created: int, text: str, finish: Any, usage: Any
    ) -> dict[str, Any]:
        return self._answer(chat, sid, created, text, finish, usage)

    def _answer(
        self, chat: bool, sid: str, created: int, text: str, finish: Any, usage: Any = False
    ) -> dict[str, Any]:
        """A whole answer (``usage`` given) or a stream chunk (``usage`` left out), in the
        chat or the completions shape."""
        chunk = usage is False
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["delta" if chunk else "message"] = {"role": "assistant", "content": text}
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        out = {"id": sid, "object": obj, "created": created, "model": self.served}
        out["choices"] = [choice]
        if not chunk:
            out["usage"] = usage
        return out

    async def _lmcache_full(
        self,
        ctx: Ctx,
        resp: Response,
        dep: Endpoint,
        chat: bool,
        sid: str,
        first_text: str,
    ) -> web.StreamResponse:
        hdrs = {"x-pd-route": ctx.route, "x-request-id": ctx.rid}
        try:
            raw = await resp.read_release()  # closed on failure or client disconnect
        except _UPSTREAM_ERRORS:
            self.metrics.upstream_errors.labels("decode", "stream").inc()
            return self._fail_response(ctx, _UpstreamFailed(502))
        finally:
            dep.active -= 1
        status = resp.status
        if status != 200:
            self._count(ctx.route, "client_error")
            return web.Response(
                status=status, body=raw, content_type="application/json", headers=hdrs
            )
        try:
            d = orjson.loads(raw)
            ch = d["choices"][0]
            text = first_text + (ch.get("text") or "")
            out = self._full_body(
                chat,
                sid,
                d.get("created", int(time.time())),
                text,
                ch.get("finish_reason"),
                handoff_lmcache.adjust_usage(d.get("usage")),
            )
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            self.metrics.upstream_errors.labels("decode", "bad_response").inc()
            return self._fail_response(ctx, _UpstreamFailed(502))
        now = time.perf_counter()
        ttft_h, _, e2e_h = self._route_hist[ctx.route]
        ttft_h.observe(now - ctx.t0)
        e2e_h.observe(now - ctx.t0)
        self._count(ctx.route, "ok")
        return web.Response(body=orjson.dumps(out), content_type="application/json", headers=hdrs)

    async def _lmcache_stream(
        self,
        ctx: Ctx,
        out: web.StreamResponse,
        resp: Response,
        dep: Endpoint,
        chat: bool,
        sid: str,
    ) -> web.StreamResponse:
        """Relay the decode leg's SSE events, re-labelled with our id (and as chat chunks)."""
        buf = b""

        def relabel(chunk: bytes) -> bytes:
            nonlocal buf
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            return b"".join(self._relabel(events, chat, sid))

        return await self._pump(ctx, out, resp, dep, relabel)

    def _relabel(self, events: list[bytes], chat: bool, sid: str) -> list[bytes]:
        """Decode-leg SSE events re-labelled with our id (and as chat chunks)."""
        outb = []
        for raw_ev in events:
            ev = raw_ev.strip()
            if not ev.startswith(b"data:"):
                continue
            payload = ev[5:].strip()
            if payload == b"[DONE]":
                outb.append(b"data: [DONE]\n\n")
                continue
            try:
                d = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if chat:
                d = handoff_lmcache.completion_to_chat_chunk(d, sid)
            else:
                d["id"] = sid
                if d.get("usage") is not None:
                    d["usage"] = handoff_lmcache.adjust_usage(d["usage"])
            outb.append(b"data: " + orjson.dumps(d) + b"\n\n")
        return outb


def build_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=router.cfg.limits.max_body_bytes)
    health_path = "/health"
    app.router.add_get(health_path, router.health)
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
