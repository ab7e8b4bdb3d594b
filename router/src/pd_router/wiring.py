"""What the router is built from, as its config asks: the engine pools, the KV-event index,
the goodput decision's cost model, the tracer, the API keys. Each choice the config makes is
made here, once, so that ``app.Router`` only assembles what these return."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pd_router import tracing
from pd_router.auth import ApiKeys
from pd_router.config import Pool, RouterConfig
from pd_router.costs import CostModel
from pd_router.discovery import EndpointPool
from pd_router.kv_events import KvEventIndex
from pd_router.metrics import Metrics
from pd_router.stall import StallWatch
from pd_router.upstream import UpstreamClient
from pd_router.weights import WeightSets

log = logging.getLogger("pd_router")


def kv_event_index(cfg: RouterConfig, m: Metrics) -> KvEventIndex | None:
    """The engines' KV events (pd_router.kv_events): only the prefix decision reads them."""
    kv = cfg.routing.kv_events
    if not kv.enabled or cfg.routing.decision != "prefix":
        return None
    return KvEventIndex(kv, lambda p, st, n: m.kv_event_engines.labels(p, st).set(n))


def pools(
    cfg: RouterConfig, changed: Callable[[EndpointPool], None], events: KvEventIndex | None
) -> tuple[EndpointPool, EndpointPool]:
    """(prefill, decode). Under ``pools.layout: flexible`` one pool, its engines in both roles
    (the legs, the hand-off and the decision see the same endpoints as prefillers and
    decoders): the same pool twice. ``changed``: told whenever a pool's healthy set changes."""
    kv = events.cfg if events is not None else None
    sets = WeightSets() if cfg.health.weights_check else None  # both pools' (pd_router.weights)

    def pool(name: str, spec: Pool) -> EndpointPool:
        return EndpointPool(name, spec, cfg.health, changed, cfg.model.served_name, kv, sets)

    decode = pool("decode", cfg.pools.decode)
    if cfg.pools.layout == "flexible":
        return decode, decode
    return pool("prefill", cfg.pools.prefill), decode


def each_pool(prefill: EndpointPool, decode: EndpointPool) -> tuple[EndpointPool, ...]:
    """The pools, each once (one under the flexible layout)."""
    return (decode,) if prefill is decode else (prefill, decode)


def stall_watch(
    cfg: RouterConfig, up: UpstreamClient, pools: tuple[EndpointPool, ...], m: Metrics
) -> StallWatch | None:
    """The watch for stalled engines (pd_router.stall); none with ``health.stallSeconds`` 0."""
    if not cfg.health.stall_seconds:
        return None
    for p in pools:  # each pool's series from the start, at 0 (an alert's increase() needs it)
        m.stalls.labels(p.name)
    return StallWatch(up, pools, cfg.health, lambda pool: m.stalls.labels(pool).inc())


def cost_model(cfg: RouterConfig, m: Metrics) -> CostModel | None:
    """The goodput decision's cost model (pd_router.costs), learnt from the legs' calls."""
    if cfg.routing.decision != "goodput":
        return None
    return CostModel(
        cfg.routing.goodput,
        report=lambda engine, what, v: m.engine_costs.labels(engine, what).set(v),
    )


def tracer(cfg: RouterConfig, m: Metrics) -> tracing.Tracer | None:
    """OpenTelemetry traces (``tracing.endpoint``): None when off, and then nothing is
    recorded."""
    if not cfg.tracing.endpoint:
        return None
    return tracing.Tracer(cfg.tracing, lambda outcome, n: m.trace_spans.labels(outcome).inc(n))


def api_keys(cfg: RouterConfig) -> tuple[ApiKeys, ApiKeys]:
    """(the clients' API keys, the tokens that may read /metrics besides them)."""
    a = cfg.auth
    keys = ApiKeys(a.api_keys_file)
    metrics_tokens = ApiKeys(a.metrics_tokens_file, field="auth.metricsTokensFile", env_var="")
    if a.protect_metrics and not (keys.enabled or metrics_tokens.enabled):
        log.warning(
            "auth.protectMetrics is on but no API key or metrics token is configured: "
            "/metrics is open"
        )
    return keys, metrics_tokens
