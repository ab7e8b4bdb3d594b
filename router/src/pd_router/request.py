"""One request's context (:class:`Ctx`), how its routes end (:class:`Fallback`), and how its
outcome is counted (:class:`Outcomes`).

The route labels of every per-request metric live here: ``direct`` (short prompt, one
decoder), ``disaggregated`` (prefill then decode), ``fallback`` (meant to be disaggregated,
served by one decoder because the hand-off could not be used; the reason is counted in
``pd_router_fallbacks_total``) and ``remote`` (another release's model, relayed to its router:
pd_router.remotes).

A request is counted once, where it ends (:meth:`Outcomes.finish`, called by the app for every
request whatever happened): the routes and legs only say how it went on its :class:`Ctx`
(``outcome``, when its first token and its end reached the client), so no exit path counts,
times or logs by hand. Per-token inter-token latency is the one measurement taken on the way
(the stream pump's), since a stream's tokens are not kept.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pd_router.adapters import Wanted
from pd_router.connectors import CONNECTORS
from pd_router.costs import Job, Meter
from pd_router.discovery import Endpoint
from pd_router.metrics import FALLBACK_REASONS, FallbackReason, Metrics
from pd_router.plan import Option
from pd_router.tracing import Trace

if TYPE_CHECKING:  # pd_router.remotes relays through the legs, which import this module
    from pd_router.remotes import Remote

DIRECT = "direct"
DISAGG = "disaggregated"
FALLBACK = "fallback"
REMOTE = "remote"  # relayed to another release's router (pd_router.remotes)
ENGINE_ROUTES = (DIRECT, DISAGG, FALLBACK)  # a request of this router's own model
ROUTES = (*ENGINE_ROUTES, REMOTE)
# How the prompt was counted (pd_router_token_count_source_total); see pd_router.decide.
COUNT_SOURCES = ("skipped", "tokens", "bound", "sampled", "tokenizer", "engine", "estimate")


class Fallback(Exception):
    """A hand-off that cannot serve this request says so by raising this before anything
    reached the client; it is then served by one decoder, its reason counted
    (pd_router.handoff.run)."""

    __slots__ = ("reason",)

    def __init__(self, reason: FallbackReason) -> None:
        assert reason in FALLBACK_REASONS, reason
        super().__init__(reason)
        self.reason: FallbackReason = reason


class Ctx:
    """Per-request state: who asked (id, path, affinity key), what (the parsed body and its
    bytes), and how it went so far (route, first token sent)."""

    __slots__ = (
        "affinity",
        "body",
        "cached",
        "cached_source",
        "chat",
        "decided",
        "decoder",
        "engine",
        "fwd",
        "headers",
        "ids",
        "job",
        "meter",
        "model",
        "outcome",
        "path",
        "predicted",
        "prefilled_on",
        "prefiller",
        "ptok",
        "raw",
        "reason",
        "remote",
        "revision",
        "rid",
        "route",
        "stream",
        "t0",
        "t_decided",
        "t_end",
        "t_first",
        "trace",
        "trace_id",
        "wanted",
    )

    def __init__(
        self, rid: str, chat: bool, path: str, fwd: bytes = b"", trace: Trace | None = None
    ) -> None:
        self.rid = rid
        self.chat = chat
        self.path = path
        self.affinity: str | None = None
        # trace context every engine call carries when no span of ours is its parent: the
        # client's (tracing off) or an unsampled trace's (pd_router.tracing); b"" = none
        self.fwd = fwd
        self.trace = trace  # this request's spans when sampled (pd_router.tracing), else None
        self.trace_id = ""  # for the access log: the trace this request belongs to, if any
        # pre-encoded upstream header block (rid is validated: no CR/LF possible)
        self.headers = b"Content-Type: application/json\r\nX-Request-Id: %s\r\n%s" % (
            rid.encode(),
            fwd,
        )
        self.route = DIRECT
        self.reason = ""  # why it went there: decide.REASONS, or the fallback's reason
        self.decoder: Endpoint | None = None  # the decision's decoder (legs prefer it)
        self.prefiller: Endpoint | None = None  # the decision's prefiller (KV events), if any
        self.cached = 0  # prompt tokens the decoder was taken to hold (x-pd-cached-tokens)
        self.cached_source = ""  # from where: decide.Decision.estimate; "" = not estimated
        self.revision = ""  # KV revision of the decoder that answered (pd_router.revision)
        self.engine = ""  # the engine that answered (the access line's "engine")
        self.prefilled_on = ""  # the engine its prefill leg went to (the access line's)
        self.t0 = time.perf_counter()
        # how it went, counted once by Outcomes.finish: the pd_router_requests_total outcome
        # ("" until known), when the first token and the end reached the client (0: not yet)
        self.outcome = ""
        self.t_first = 0.0
        self.t_end = 0.0
        self.decided = False  # the routing decision was taken (pd_router_decisions_total)
        self.raw = b""  # the body as it goes to an engine unchanged
        self.body: dict[str, Any] = {}
        self.stream = False
        self.ptok = 0  # prompt tokens as the decision saw them, exact or estimated; 0: uncounted
        self.ids: list[int] | None = None  # prompt token ids when known (reused by LMCache)
        # decision goodput (pd_router.plan): the option taken with its predictions, the
        # request's tie to the cost model, the decoder call now answering, when it was decided
        self.predicted: Option | None = None
        self.meter: Meter | None = None
        self.job: Job | None = None
        self.t_decided = 0.0
        # what its engines must serve (pd_router.adapters: a LoRA adapter, a KV revision the
        # client named); None: any engine. ``model``: its pd_router_model_requests_total label
        self.wanted: Wanted | None = None
        self.model = ""
        self.remote: Remote | None = None  # another release's model (pd_router.remotes)

    # -------------------------------------------------- what the client got (legs.Downstream)
    # The outcome follows from what reached the client, recorded by the Downstream that sent
    # it, never by a route's exit: a route answers, and this says how that went.
    def replied(self, status: int) -> None:
        """A whole answer of ``status``: its first token and its end arrive together."""
        if status < 400:
            self.outcome = "ok"
            self.t_first = self.t_end = time.perf_counter()
        else:
            self.outcome = "client_error" if status < 500 else "upstream_error"

    def stream_ended(self) -> None:
        self.outcome = "ok"
        self.t_end = time.perf_counter()

    def stream_failed(self) -> None:
        """An error event ended a stream whose 200 was sent."""
        self.outcome = "upstream_error"

    def client_gone(self) -> None:
        self.outcome = "client_disconnect"

    def reply_headers(self) -> dict[str, str]:
        h = {"x-pd-route": self.route, "x-pd-reason": self.reason, "x-request-id": self.rid}
        if self.revision:
            h["x-pd-kv-revision"] = self.revision
        if self.cached_source:
            h["x-pd-cached-tokens"] = f"{self.cached}; source={self.cached_source}"
        if self.predicted is not None:
            h["x-pd-predicted"] = self.predicted.header()
        return h


class Outcomes:
    """How requests went: set on each request's :class:`Ctx` by the routes and legs, counted by
    :meth:`finish`; the counters of events inside a request (upstream errors, retries,
    fallbacks, hand-off waits) are counted as they happen."""

    def __init__(self, metrics: Metrics) -> None:
        m = self.metrics = metrics
        # bound children, found once per label set (labels() takes a lock and builds a key)
        self._requests: dict[tuple[str, str], Any] = {}
        self._models: dict[tuple[str, str], Any] = {}
        self._decisions: dict[tuple[str, str], Any] = {}
        self._estimates: dict[str, Any] = {}
        self._hist = {r: (m.ttft.labels(r), m.itl.labels(r), m.e2e.labels(r)) for r in ROUTES}
        self._predicted = {r: m.ttft_prediction.labels(r) for r in ROUTES}
        self._sources = {s: m.token_count_source.labels(s) for s in COUNT_SOURCES}
        self._wait = {c: m.handoff_wait.labels(c) for c in CONNECTORS}

    # ------------------------------------------------------------------ how it ended
    def first_token(self, ctx: Ctx) -> None:
        """A stream's first token reached the client."""
        ctx.t_first = time.perf_counter()

    def refused(self, ctx: Ctx, outcome: str) -> None:
        """The router answered it itself before routing (unauthorized, rejected, ...)."""
        ctx.route = "none"
        ctx.outcome = outcome

    def finish(self, ctx: Ctx) -> None:
        """Count ``ctx`` once, where it ends: its route and outcome, time to first token and
        end to end, its routing decision. A request that ended with nothing recorded (an
        exception no route caught: the server answered 500) is ``internal_error``."""
        if not ctx.outcome:
            ctx.outcome = "internal_error"
        key = (ctx.route, ctx.outcome)
        c = self._requests.get(key)
        if c is None:
            c = self._requests[key] = self.metrics.requests.labels(*key)
        c.inc()
        if ctx.model:
            m = self._models.get((ctx.model, ctx.route))
            if m is None:
                m = self._models[(ctx.model, ctx.route)] = self.metrics.model_requests.labels(
                    ctx.model, ctx.route
                )
            m.inc()
        if ctx.outcome == "client_disconnect":
            self.metrics.client_disconnects.inc()
        hist = self._hist.get(ctx.route)
        if hist is not None:
            if ctx.t_first:
                hist[0].observe(ctx.t_first - ctx.t0)
                p = ctx.predicted
                if p is not None and ctx.stream and p.ttft > 0 and ctx.outcome == "ok":
                    self._predicted[ctx.route].observe((ctx.t_first - ctx.t_decided) / p.ttft)
            if ctx.t_end:
                hist[2].observe(ctx.t_end - ctx.t0)
        if ctx.decided:
            key = (ctx.route, ctx.reason)
            c = self._decisions.get(key)
            if c is None:
                c = self._decisions[key] = self.metrics.decisions.labels(*key)
            c.inc()

    # ------------------------------------------------------------------ events on the way
    def hist(self, route: str) -> tuple[Any, Any, Any]:
        """(time to first token, inter-token latency, end to end) histograms of a route."""
        return self._hist[route]

    def upstream(self, pool: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(pool, kind).inc()

    def fallback(self, ctx: Ctx, reason: FallbackReason) -> None:
        """``ctx`` is served another way than decided, for ``reason``."""
        self.metrics.fallbacks.labels(reason).inc()
        ctx.route = FALLBACK
        ctx.reason = reason
        if ctx.trace is not None:
            ctx.trace.fallback(reason)

    def prefix(self, matched: int, uncached: int, source: str) -> None:
        self.metrics.prefix_matched.observe(matched)
        self.metrics.uncached.observe(uncached)
        if source:
            c = self._estimates.get(source)
            if c is None:
                c = self._estimates[source] = self.metrics.prefix_estimates.labels(source)
            c.inc()

    def batch(self, reason: str) -> None:
        """A request for several completions, served directly (openai_wire.batch_reason)."""
        self.metrics.batch_requests.labels(reason).inc()

    def retry(self, pool: str) -> None:
        self.metrics.retries.labels(pool).inc()

    def counted(self, source: str, tokens: int | None) -> None:
        self._sources[source].inc()
        if tokens is not None:
            self.metrics.prompt_tokens.observe(tokens)

    def handoff_wait(self, connector: str, seconds: float) -> None:
        self._wait[connector].observe(seconds)
