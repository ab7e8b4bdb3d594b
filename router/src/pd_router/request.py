"""One request's context (:class:`Ctx`) and how its outcome is counted (:class:`Outcomes`).

The route labels of every per-request metric live here: ``direct`` (short prompt, one
decoder), ``disaggregated`` (prefill then decode) and ``fallback`` (meant to be disaggregated,
served by one decoder because the hand-off could not be used; the reason is counted in
``pd_router_fallbacks_total``).
"""

from __future__ import annotations

import time
from typing import Any

from pd_router.discovery import Endpoint
from pd_router.metrics import Metrics

DIRECT = "direct"
DISAGG = "disaggregated"
FALLBACK = "fallback"
ROUTES = (DIRECT, DISAGG, FALLBACK)
# How the prompt was counted (pd_router_token_count_source_total); see pd_router.decide.
COUNT_SOURCES = ("skipped", "tokens", "bound", "sampled", "tokenizer", "engine", "estimate")


class Ctx:
    """Per-request state: who asked (id, path, affinity key), what (the parsed body and its
    bytes), and how it went so far (route, first token sent)."""

    __slots__ = (
        "affinity",
        "body",
        "chat",
        "decoder",
        "headers",
        "ids",
        "path",
        "ptok",
        "raw",
        "reason",
        "rid",
        "route",
        "stream",
        "t0",
        "ttft_done",
    )

    def __init__(self, rid: str, chat: bool, path: str) -> None:
        self.rid = rid
        self.chat = chat
        self.path = path
        self.affinity: str | None = None
        # pre-encoded upstream header block (rid is validated: no CR/LF possible)
        self.headers = b"Content-Type: application/json\r\nX-Request-Id: %s\r\n" % rid.encode()
        self.route = DIRECT
        self.reason = ""  # why it went there: decide.REASONS, or the fallback's reason
        self.decoder: Endpoint | None = None  # the decision's decoder (legs prefer it)
        self.t0 = time.perf_counter()
        self.ttft_done = False
        self.raw = b""  # the body as it goes to an engine unchanged
        self.body: dict[str, Any] = {}
        self.stream = False
        self.ptok = 0  # prompt tokens as the decision saw them, exact or estimated; 0: uncounted
        self.ids: list[int] | None = None  # prompt token ids when known (reused by LMCache)

    def reply_headers(self) -> dict[str, str]:
        return {"x-pd-route": self.route, "x-pd-reason": self.reason, "x-request-id": self.rid}


class Outcomes:
    """Counting of requests and their legs, with the labelled children resolved once."""

    def __init__(self, metrics: Metrics) -> None:
        m = self.metrics = metrics
        self._requests: dict[tuple[str, str], Any] = {}
        self._hist = {r: (m.ttft.labels(r), m.itl.labels(r), m.e2e.labels(r)) for r in ROUTES}
        self._sources = {s: m.token_count_source.labels(s) for s in COUNT_SOURCES}
        self._wait = {c: m.handoff_wait.labels(c) for c in ("nixl", "lmcache")}

    def count(self, route: str, outcome: str) -> None:
        c = self._requests.get((route, outcome))
        if c is None:
            c = self._requests[(route, outcome)] = self.metrics.requests.labels(route, outcome)
        c.inc()

    def hist(self, route: str) -> tuple[Any, Any, Any]:
        """(time to first token, inter-token latency, end to end) histograms of a route."""
        return self._hist[route]

    def answered(self, ctx: Ctx) -> None:
        """A whole (non-streamed) answer: its first token and its end arrive together."""
        ttft, _, e2e = self._hist[ctx.route]
        dt = time.perf_counter() - ctx.t0
        ttft.observe(dt)
        e2e.observe(dt)

    def first_token(self, ctx: Ctx) -> None:
        self._hist[ctx.route][0].observe(time.perf_counter() - ctx.t0)
        ctx.ttft_done = True

    def finished(self, ctx: Ctx) -> None:
        self._hist[ctx.route][2].observe(time.perf_counter() - ctx.t0)

    def disconnect(self, ctx: Ctx) -> None:
        self.metrics.client_disconnects.inc()
        self.count(ctx.route, "client_disconnect")

    def upstream(self, pool: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(pool, kind).inc()

    def fallback(self, ctx: Ctx, reason: str) -> None:
        """``ctx`` is served another way than decided, for ``reason``."""
        self.metrics.fallbacks.labels(reason).inc()
        ctx.route = FALLBACK
        ctx.reason = reason

    def prefix(self, matched: int, uncached: int) -> None:
        self.metrics.prefix_matched.observe(matched)
        self.metrics.uncached.observe(uncached)

    def decided(self, ctx: Ctx) -> None:
        """Where the request went and why (counted when its route is final)."""
        self.metrics.decisions.labels(ctx.route, ctx.reason).inc()

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
