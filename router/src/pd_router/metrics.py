"""Prometheus metrics of the router (names prefixed ``pd_router_``).

With several worker processes (``listen.workers``, pd_router.workers) prometheus-client runs
in its multiprocess mode: the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before any worker
imports prometheus_client, every worker's values live in files there, and whichever worker
answers a scrape renders all of them (counters and histograms summed; each gauge declares how
its workers' values combine).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pd_router import revision, weights
from pd_router.discovery import Endpoint
from pd_router.openai_wire import PASSTHROUGH_PATHS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# where a decision's cached-prefix figure came from (pd_router.decide Decision.estimate)
ESTIMATE_SOURCES = ("events", "approximate")
KV_EVENT_OUTCOMES = ("applied", "replayed", "gap", "restarted", "malformed")  # pd_router.kv_events
_TOK = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


# Label values created at start-up with a count of 0, so the first event is an increase that
# rate() and the chart's alerts see (a series born at 1 has no increase) and a fresh release shows
# on the dashboard. tests check that these are the values app.py records.
ROUTES_OUTCOMES = (
    ("direct", "ok"),
    ("disaggregated", "ok"),
    ("fallback", "ok"),
    ("none", "rejected"),
)
# Why a request meant for the hand-off was served by one decoder (pd_router_fallbacks_total,
# x-pd-reason): the one list, typed, that the routes raise (request.Fallback) and tests iterate.
FallbackReason = Literal[
    "unsupported_fields", "no_prefiller", "prefill_error", "prefill_timeout", "no_kv_params",
    "tokenize_error", "unknown_max_tokens", "notify_timeout", "decode_retry", "too_long",
    "reasoning_parser", "prefill_refused", "no_revision_pair", "weights_differ", "handoff_failing",
    "no_adapter_pair",
]  # fmt: skip
FALLBACK_REASONS: tuple[FallbackReason, ...] = get_args(FallbackReason)
# ... of which the request is the cause, not a broken hand-off (the chart's
# PDInferenceFallbackShareHigh leaves these out; tests/observability checks the two agree)
CLIENT_CAUSED: tuple[FallbackReason, ...] = (
    "unsupported_fields", "unknown_max_tokens", "too_long", "reasoning_parser", "prefill_refused",
)  # fmt: skip
# ... that a rollout of both roles causes while it lasts, with an alert of their own that waits
# longer (PDInferenceNoRevisionPair), so PDInferenceFallbackShareHigh leaves them out too
ROLLOUT: tuple[FallbackReason, ...] = ("no_revision_pair",)
REJECT_REASONS = ("queue_full", "queue_timeout")
# pd_router_decisions_total{route, reason}: what pd_router.decide returns (a fallback is counted
# with route fallback and its FALLBACK_REASONS reason)
DECIDED = (
    ("direct", "batch"),
    ("direct", "below_threshold"),
    ("direct", "prefix_cached"),
    ("direct", "prefill_busy"),
    ("disaggregated", "always"),
    ("disaggregated", "above_threshold"),
    # routing.decision goodput (pd_router.plan)
    ("direct", "handoff_not_worth"),
    ("direct", "whole_best"),
    ("direct", "one_engine_enough"),
    ("disaggregated", "split_protects_itl"),
    ("disaggregated", "split_faster"),
)
# observed / predicted time to first token (routing.decision goodput, streamed answers)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
# pd_router_batch_requests_total{reason}: openai_wire.batch_reason (n > 1, several prompts)
BATCH_REASONS = ("n", "prompts")
SIDECAR_OUTCOMES = ("ok", "timeout", "error")
TRACE_SPAN_OUTCOMES = ("exported", "failed", "dropped")  # pd_router.tracing.Exporter


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        # pool -> every KV revision it has had, and every (revision, weight set)
        self._revisions: dict[str, set[tuple[str, ...]]] = {}
        self._weight_sets: dict[str, set[tuple[str, ...]]] = {}
        self._declare_requests(r)
        self._declare_decision(r)
        self._declare_engines(r)
        self._declare_admission(r)
        self._declare_rest(r)
        self._preset()

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """What each request was and took: route, outcome, TTFT, gaps, end to end, its prompt."""
        self.requests = Counter(
            "pd_router_requests", "Requests by route and outcome", ["route", "outcome"], registry=r
        )
        # by the model a request named (the served model or a configured LoRA adapter:
        # pd_router.adapters; bounded, never the client's own string), apart from
        # pd_router_requests_total so that the alerts' and dashboards' series keep their labels
        self.model_requests = Counter(
            "pd_router_model_requests",
            "Requests by the model they named (served model or LoRA adapter) and route",
            ["model", "route"],
            registry=r,
        )
        self.ttft = Histogram(
            "pd_router_ttft_seconds",
            "Router-observed time to first token",
            ["route"],
            buckets=_LAT,
            registry=r,
        )
        self.itl = Histogram(
            "pd_router_inter_token_seconds",
            "Router-observed gap between streamed chunks",
            ["route"],
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "pd_router_e2e_seconds",
            "End-to-end request latency",
            ["route"],
            buckets=_LAT,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "pd_router_prompt_tokens",
            "Prompt tokens per request (as counted for routing)",
            buckets=_TOK,
            registry=r,
        )
        self.token_count_source = Counter(
            "pd_router_token_count",
            "How prompt tokens were counted "
            "(tokens|bound|sampled|tokenizer|engine|estimate|skipped; pd_router.decide)",
            ["source"],
            registry=r,
        )
        self.tokenizer_loaded = Gauge(
            "pd_router_tokenizer_loaded",
            "1 when the router counts with a local tokenizer from this source (file|hub)",
            ["source"],
            registry=r,
            multiprocess_mode="livemin",  # 1 only when every worker has it
        )

    def _declare_decision(self, r: CollectorRegistry) -> None:
        """The routing decision and the hand-off: reasons, prefix estimates, KV events, waits."""
        self.handoff_wait = Histogram(
            "pd_router_handoff_wait_seconds",
            "Prefill leg plus KV hand-off wait",
            ["connector"],
            buckets=_LAT,
            registry=r,
        )
        self.decisions = Counter(
            "pd_router_decisions",
            "Requests by the route they were served on and why (pd_router.decide; the reason "
            "is the x-pd-reason header)",
            ["route", "reason"],
            registry=r,
        )
        self.prefix_matched = Histogram(
            "pd_router_prefix_matched_tokens",
            "Prompt tokens the chosen decoder is estimated to hold in its prefix cache "
            "(routing.decision prefix)",
            buckets=(0, *_TOK),
            registry=r,
        )
        self.uncached = Histogram(
            "pd_router_uncached_prompt_tokens",
            "Prompt tokens the chosen decoder is estimated not to hold: what the threshold "
            "is compared with (routing.decision prefix)",
            buckets=_TOK,
            registry=r,
        )
        self.prefix_estimates = Counter(
            "pd_router_prefix_estimates",
            "Decisions by where the chosen decoder's cached-prefix figure came from: events "
            "(the engines' KV events, exact), approximate (the router's own index)",
            ["source"],
            registry=r,
        )
        self.kv_event_batches = Counter(
            "pd_router_kv_event_batches",
            "KV-event batches from the engines by outcome: applied, replayed (recovered from "
            "an engine's replay endpoint), gap (missed, picture dropped), restarted (a new "
            "publisher), malformed",
            ["outcome"],
            registry=r,
        )
        self.kv_event_engines = Gauge(
            "pd_router_kv_events_engines",
            "Subscribed engines by pool and whether their KV-event picture is exact or "
            "uncertain (after a gap that could not be replayed: the approximate index stands in)",
            ["pool", "state"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def _declare_engines(self, r: CollectorRegistry) -> None:
        """The engines as the router sees them: errors, fallbacks, retries, health, KV revisions."""
        self.upstream_errors = Counter(
            "pd_router_upstream_errors",
            "Upstream failures by pool and kind",
            ["pool", "kind"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pd_router_fallbacks",
            "Disaggregated requests served directly instead",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "pd_router_retries", "Requests retried on another endpoint", ["pool"], registry=r
        )
        self.stalls = Counter(
            "pd_router_engine_stalls",
            "Engines found stalled (silent with calls waiting, health check failed): ejected, "
            "the calls waiting on them failed at once",
            ["pool"],
            registry=r,
        )
        self.healthy = Gauge(
            "pd_router_healthy_endpoints",
            "Healthy endpoints by pool",
            ["pool"],
            registry=r,
            multiprocess_mode="livemax",  # each worker checks the pool itself
        )
        self.endpoints = Gauge(
            "pd_router_endpoints",
            "Known endpoints by pool",
            ["pool"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.kv_revisions = Gauge(
            "pd_router_kv_revision_endpoints",
            "Healthy endpoints by pool and KV-compatibility revision (pd_router.revision; "
            'revision "" names none, "unknown" not read yet); a revision gone reads 0',
            ["pool", "revision"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.weight_sets = Gauge(
            "pd_router_weight_set_endpoints",
            "Healthy endpoints by pool, KV revision and the weight set of it their answer to the "
            'weights probe placed them in (pd_router.weights; "unknown" not read yet); engines '
            "of one revision in two sets hold different weights; a set gone reads 0",
            ["pool", "revision", "weights"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def _declare_admission(self, r: CollectorRegistry) -> None:
        """Admission and the client side: in flight, queued, refused, gone."""
        self.in_flight = Gauge(
            "pd_router_in_flight", "Requests being served", registry=r, multiprocess_mode="livesum"
        )
        self.outstanding = Gauge(
            "pd_router_outstanding",
            "Requests this router has on the endpoints of a pool (what balancing compares)",
            ["pool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queued = Gauge(
            "pd_router_queued",
            "Requests waiting for a slot",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rejected = Counter(
            "pd_router_rejected", "Requests rejected before routing", ["reason"], registry=r
        )
        self.notifications = Counter(
            "pd_router_lmcache_notifications",
            "LMCache ProxyNotif messages received (matched|unknown|malformed)",
            ["result"],
            registry=r,
        )
        self.sidecar_waits = Counter(
            "pd_router_lmcache_sidecar_waits",
            "Waits on a prefill pod's notification sidecar (ok|timeout|error)",
            ["outcome"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "pd_router_client_disconnects", "Clients that went away mid-request", registry=r
        )
        self.batch_requests = Counter(
            "pd_router_batch_requests",
            "Requests for several completions, served directly whatever their prompt length "
            "(n: n > 1; prompts: several prompts): a hand-off carries one sequence",
            ["reason"],
            registry=r,
        )

    def _declare_rest(self, r: CollectorRegistry) -> None:
        """Traces, the goodput decision's model, the other endpoints."""
        self.trace_spans = Counter(
            "pd_router_trace_spans",
            "Spans of sampled requests by what became of them (tracing): exported (the "
            "collector took them), failed (the exporter gave up on its batch), dropped (the "
            "export queue was full)",
            ["outcome"],
            registry=r,
        )
        self.ttft_prediction = Histogram(
            "pd_router_ttft_prediction_ratio",
            "Observed over predicted time to first token of streamed requests, from the "
            "decision (routing.decision goodput): the cost model's error",
            ["route"],
            buckets=_RATIO,
            registry=r,
        )
        self.engine_costs = Gauge(
            "pd_router_engine_cost",
            "What the goodput decision's cost model believes of each engine (routing.decision "
            "goodput; pd_router.costs): prefill_seconds_per_token, stall_seconds_per_token (what "
            "a prompt token adds to the step that prefills it, as its streams saw it), "
            "decode_step_seconds (at its current streams), slow_gap_share (of its streams' gaps "
            "past routing.goodput.itlSeconds), chunk_tokens",
            ["engine", "quantity"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.passthrough = Counter(
            "pd_router_passthrough_requests",
            "Requests to vLLM's other endpoints (/v1/responses, /tokenize, ...), relayed to a "
            "decoder as they are",
            ["endpoint"],
            registry=r,
        )

    def pool_changed(
        self, pool: str, healthy: int, endpoints: int, engines: Sequence[Endpoint]
    ) -> None:
        """A pool's engines changed: its healthy and known counts, and its healthy engines by
        KV revision (a revision gone is set to 0, not removed: worker files keep it)."""
        self.healthy.labels(pool).set(healthy)
        self.endpoints.labels(pool).set(endpoints)
        _census(self.kv_revisions, self._revisions.setdefault(pool, set()), pool, {
            (rev,): n for rev, n in revision.census(engines).items()
        })  # fmt: skip
        _census(
            self.weight_sets,
            self._weight_sets.setdefault(pool, set()),
            pool,
            weights.census(engines),
        )

    def models(self, names: Sequence[str], routes: Sequence[str]) -> None:
        """Preset pd_router_model_requests_total for the served model and its adapters (the
        remote models' under route ``remote``: pd_router.remotes)."""
        for name in names:
            for route in routes:
                self.model_requests.labels(name, route)

    def remote_models(self, names: Sequence[str], route: str) -> None:
        """Preset the series of requests relayed to other releases' routers (pd_router.remotes,
        under ``route``), by their configured names; none without remote models."""
        for name in names:
            self.model_requests.labels(name, route)
        if names:
            self.requests.labels(route, "ok")  # born at 0, as ROUTES_OUTCOMES' are

    def _preset(self) -> None:
        """Every known label set at 0, so a series exists before its first event."""
        for route, outcome in ROUTES_OUTCOMES:
            self.requests.labels(route, outcome)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
            self.decisions.labels("fallback", reason)
        for route, reason in DECIDED:
            self.decisions.labels(route, reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for reason in BATCH_REASONS:
            self.batch_requests.labels(reason)
        for path in PASSTHROUGH_PATHS:
            self.passthrough.labels(path)
        for source in ESTIMATE_SOURCES:
            self.prefix_estimates.labels(source)
        for outcome in KV_EVENT_OUTCOMES:
            self.kv_event_batches.labels(outcome)
        for outcome in TRACE_SPAN_OUTCOMES:
            self.trace_spans.labels(outcome)

    def preset_lmcache(self, receiver: str) -> None:
        """The LMCache hand-off's counters, for the notification receiver in use."""
        # a broken hand-off is a prefiller failure (kind notify_timeout | sidecar_error)
        self.upstream_errors.labels("prefill", "notify_timeout")
        if receiver == "router":
            for result in ("matched", "unknown", "malformed"):
                self.notifications.labels(result)
        else:
            self.upstream_errors.labels("prefill", "sidecar_error")
            for outcome in SIDECAR_OUTCOMES:
                self.sidecar_waits.labels(outcome)

    def render(self) -> bytes:
        path = os.environ.get(MULTIPROC_ENV)
        if not path:
            return generate_latest(self.registry)
        every_worker = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(every_worker, path)
        return generate_latest(every_worker)


def _census(gauge: Gauge, seen: set[tuple[str, ...]], pool: str, live: dict[Any, int]) -> None:
    """A pool's healthy engines by label values (``live``); those gone read 0, not removed:
    worker files keep them."""
    for key in seen - live.keys():
        gauge.labels(pool, *key).set(0)
    for key, n in live.items():
        gauge.labels(pool, *key).set(n)
    seen |= live.keys()
