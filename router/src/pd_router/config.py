"""Router configuration: the YAML contract the Helm chart renders, plus env overrides.

The loader is strict: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` whose message names the dotted field path (``routing.threshold``).
YAML keys are camelCase (as in the chart); attributes are the snake_case equivalents.

Env overrides: ``PD_ROUTER__<SECTION>__<FIELD>[__<FIELD>...]=value`` (case-insensitive path
parts), the value parsed as a YAML scalar/flow value and validated like the file.

Hand-written rather than msgspec's typed decoding (already a dependency): msgspec would replace
only the type walk, not the env overrides by path, the camelCase names in errors or the
cross-field rules below, and it reports ``$.routing.threshold`` where users wrote YAML.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from pd_router import connectors

ENV_PREFIX = "PD_ROUTER__"
# The LMCache notification ports' defaults (the chart's ports.proxyNotification and
# ports.notificationSidecar), one home for the config, the CLI and the sidecar.
NOTIFY_PORT = 7500
SIDECAR_PORT = 7600
# An HTTP header name (RFC 9110 token); the chart's schema takes it from here (ci/chartdoc.py).
HEADER_NAME_RE = r"[A-Za-z0-9!#$%&'*+.^_`|~-]+"
MIN_MAX_BODY_BYTES = 1024
# Header fields a request may carry (limits.maxHeaders, 431 above): Envoy's max_headers_count
# default (HttpProtocolOptions, Envoy 1.36); aiohttp 3.14's server allowed 128. Below the
# minimum an SDK's own headers and a proxy's would not fit.
MAX_HEADERS = 100
MIN_MAX_HEADERS = 32
# bounds of the notification sidecar's wait endpoint (pd_router.handoff.lmcache_sidecar)
SIDECAR_MAX_COUNT = 64
SIDECAR_MAX_TIMEOUT = 600.0


class ConfigError(ValueError):
    """Invalid router configuration; the message names the offending dotted field."""


MAX_WORKERS = 64


@dataclass(frozen=True)
class Listen:
    host: str = "0.0.0.0"
    port: int = 8000
    # Worker processes sharing the port (SO_REUSEPORT, pd_router.workers); 0 = one per CPU of
    # the container's CPU limit. limits.maxInFlight/maxQueued are shared out among them.
    workers: int = 1


@dataclass(frozen=True)
class TokenizerHub:
    """Fetch ``tokenizer.json`` of ``repo`` at ``revision`` from a Hugging Face-compatible hub
    once at start-up (pd_router.hub_tokenizer). Empty ``repo`` = off."""

    repo: str = ""
    revision: str = "main"
    endpoint: str = "https://huggingface.co"
    token_file: str = ""
    # all attempts together; the chart's router startupProbe allows 60 s before /health answers
    timeout_seconds: float = 30.0


@dataclass(frozen=True)
class Model:
    served_name: str = "llama-3.3-70b"
    tokenizer: str = ""
    tokenizer_hub: TokenizerHub = field(default_factory=TokenizerHub)
    # the engines' --reasoning-parser ("" = none): the LMCache route then serves chat requests
    # directly (their answers split reasoning from content, which its decode leg cannot)
    reasoning_parser: str = ""
    # the LoRA adapters the engines serve beside the model (the chart's model.lora.adapters,
    # by name): what a request may name in ``model`` besides ``servedName``, each sent only to
    # engines that list it (pd_router.adapters); the bound on the ``model`` metric label
    adapters: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixCache:
    """The router's estimate of each decoder's vLLM prefix cache (pd_router.prefix)."""

    # per decoder, per router process, at most: what one decoder's KV cache holds (less where
    # the decoder's vllm:cache_config_info says less); 262144 is a 70B model at TP 8 on an H100
    # node. The block size is the decoder's own (pd_router.cache_info), never configured.
    capacity_tokens: int = 262144
    # the decoder holding the longest prefix is passed over when it has this many more requests
    # in flight than the least busy decoder (a hot prefix must not pin all load on one pod)
    max_load_imbalance: int = 8


@dataclass(frozen=True)
class PrefillBusy:
    """Serve directly when the prefill pool is saturated and the decoder has room."""

    # prompt tokens in flight on every healthy prefiller at or above which it counts as busy;
    # 0 = never bypass the prefill pool. 65536: seconds of queued prefill, measured in
    # docs/router.md "Decode-first decision" (lower trades decode ITL for long-prompt TTFT)
    queued_tokens: int = 65536
    # ... and only if the chosen decoder has fewer requests in flight than this
    max_decoder_requests: int = 32


@dataclass(frozen=True)
class KvEvents:
    """vLLM's KV-cache events (pd_router.kv_events): each engine publishes the blocks it stores
    and evicts; the router subscribes to every discovered engine that says so on
    ``/kv_event_sources`` and routes on what the engines hold. An engine that does not publish
    (or publishes elsewhere than ``port``/``topic``) keeps the approximate index."""

    enabled: bool = True
    # the port every engine publishes on (vLLM's default, KVEventsConfig 0.31.0) and the port of
    # its replay ROUTER; 0 = whatever each engine says (static pools of engines on one host)
    port: int = 5557
    replay_port: int = 5558
    topic: str = "kv"


@dataclass(frozen=True)
class GoodputSeed:
    """Starting points of the goodput decision's cost estimates (pd_router.costs), learnt
    from the engines either way; 0 = the router's built-in prior."""

    prefill_tokens_per_second: float = 0.0
    decode_step_seconds: float = 0.0
    handoff_seconds: float = 0.0
    # the engines' max_num_batched_tokens (vLLM's chunk a step), which they do not say: 0 =
    # 2048, vLLM 0.31's default for the API server on CPU and below 70 GiB of device memory
    # (8192 on H100/H200: engine/arg_utils.py)
    chunk_tokens: float = 0.0
    # how much slower an engine decodes while every other engine works (engines sharing cores
    # or memory bandwidth: 2 = three times as slow; engines on GPUs of their own: 0). Learnt
    # only where the others are seen both idle and at work: under steady load they always are
    # at work, and the step alone cannot be told from the crowding (pd_router.costs.StepFit)
    crowding: float = 0.0


@dataclass(frozen=True)
class Goodput:
    """The service-level objectives the ``goodput`` decision keeps requests within
    (pd_router.plan): a request meets them when its time to first token is at most
    ``ttftSeconds + ttftSecondsPerKiloToken x prompt tokens / 1000`` and the 95th percentile of
    its inter-token latency at most ``itlSeconds`` (DistServe's goodput)."""

    ttft_seconds: float = 1.0
    ttft_seconds_per_kilo_token: float = 0.25
    itl_seconds: float = 0.1
    # how far back the load and cost estimates look: a shift in the traffic moves them within it
    window_seconds: float = 5.0
    seed: GoodputSeed = field(default_factory=GoodputSeed)


@dataclass(frozen=True)
class Routing:
    # one of pd_router.connectors (its names as a Literal: the loader refuses others, naming them)
    connector: Literal[connectors.NAMES] = connectors.DEFAULT  # type: ignore[valid-type]
    threshold: int = 1024
    session_affinity_header: str = ""
    # prefix: decoder first, disaggregate by the prompt tokens it does not hold (and bypass a
    # busy prefill pool); length: the prompt's length alone (HyperPod's routingThreshold rule);
    # goodput: per request, whole on one engine or prefill on one and decode on another, from
    # measured costs (pd_router.plan)
    decision: Literal["prefix", "length", "goodput"] = "prefix"
    goodput: Goodput = field(default_factory=Goodput)
    prefix_cache: PrefixCache = field(default_factory=PrefixCache)
    prefill_busy: PrefillBusy = field(default_factory=PrefillBusy)
    kv_events: KvEvents = field(default_factory=KvEvents)


@dataclass(frozen=True)
class Dns:
    name: str = ""
    port: int = 8000
    refresh_seconds: float = 10.0


@dataclass(frozen=True)
class Pool:
    discovery: Literal["dns", "static"] = "dns"
    static: list[str] = field(default_factory=list)
    dns: Dns = field(default_factory=Dns)


def _prefill_pool() -> Pool:
    return Pool(dns=Dns(name="pd-pd-inference-prefill.default.svc.cluster.local"))


def _decode_pool() -> Pool:
    return Pool(dns=Dns(name="pd-pd-inference-decode.default.svc.cluster.local"))


@dataclass(frozen=True)
class Pools:
    # split: prefillers (pools.prefill) and decoders (pools.decode); flexible: one pool,
    # pools.decode, whose every engine can prefill for another, decode what another prefilled
    # or serve a request whole (vLLM NixlConnector with kv_role kv_both); pools.prefill is then
    # refused, not ignored
    layout: Literal["split", "flexible"] = "split"
    prefill: Pool = field(default_factory=_prefill_pool)
    decode: Pool = field(default_factory=_decode_pool)


@dataclass(frozen=True)
class LMCache:
    notify_bind_host: str = "0.0.0.0"
    notify_port: int = NOTIFY_PORT
    notifications_per_request: int = 1
    decoder_init_ports: list[int] = field(default_factory=lambda: [7300])
    decoder_alloc_ports: list[int] = field(default_factory=lambda: [7400])
    notify_timeout_seconds: float = 30.0
    # router: this process binds notifyBindHost:notifyPort (one router replica);
    # prefillSidecar: a `pd-router notify-sidecar` next to every prefiller receives them and the
    # router asks the one of the prefill pod it used (router replicas scale).
    notification_receiver: Literal["router", "prefillSidecar"] = "router"
    sidecar_port: int = SIDECAR_PORT


@dataclass(frozen=True)
class Timeouts:
    connect_seconds: float = 5.0
    # a client's whole request body must arrive within this (408 otherwise)
    client_body_seconds: float = 30.0
    # a keep-alive connection idle this long between requests is closed
    client_idle_seconds: float = 60.0
    # a new connection must deliver a whole request head (line + headers) within this
    client_header_seconds: float = 10.0
    prefill_seconds: float = 300.0
    first_byte_seconds: float = 300.0
    stream_idle_seconds: float = 120.0


@dataclass(frozen=True)
class Health:
    path: str = "/health"
    interval_seconds: float = 5.0
    timeout_seconds: float = 2.0
    healthy_threshold: int = 1
    unhealthy_threshold: int = 3
    passive_failure_threshold: int = 3
    # An endpoint ejected for failed requests stays out this long, doubled with each ejection in
    # a row (up to maxEjectionSeconds; a request it serves well resets it), whatever its active
    # check says: /health can answer while what failed (an LMCache notification path, a KV
    # transfer) does not, and a re-admission at the next check made every long request wait
    # out its timeout again (Envoy's outlier detection does the same).
    ejection_seconds: float = 30.0
    max_ejection_seconds: float = 300.0
    # An engine with calls waiting on it that sends nothing for this long and fails its health
    # check is stalled: ejected, and what waits on it fails now (pd_router.stall). 0 = off.
    stall_seconds: float = 5.0
    # Engines of one KV revision are paired only where they answer a fixed probe alike
    # (pd_router.weights): one 1-token completion per admission.
    weights_check: bool = True

    def ejection_for(self, nth: int) -> float:
        """Seconds out at the ``nth`` ejection in a row (1: the first): ``ejectionSeconds``
        doubled each time, up to ``maxEjectionSeconds`` (engines: pd_router.discovery; hand-off
        pairs: pd_router.pairs)."""
        return min(self.max_ejection_seconds, self.ejection_seconds * 2 ** (nth - 1))


@dataclass(frozen=True)
class Limits:
    max_in_flight: int = 512
    max_queued: int = 1024
    queue_timeout_seconds: float = 30.0
    max_body_bytes: int = 10 * 1024 * 1024
    max_headers: int = MAX_HEADERS


@dataclass(frozen=True)
class Auth:
    api_keys_file: str = ""
    protect_metrics: bool = False
    # Tokens that open /metrics and nothing else (Prometheus' scrape credential): a scraper
    # never holds a key that can also spend GPU time.
    metrics_tokens_file: str = ""


@dataclass(frozen=True)
class Logging:
    level: Literal["debug", "info", "warning", "error"] = "info"
    log_prompts: bool = False


@dataclass(frozen=True)
class Tracing:
    """OpenTelemetry traces over OTLP (pd_router.tracing). Empty ``endpoint`` = off: the router
    imports no OpenTelemetry and records nothing; a client's ``traceparent`` still reaches the
    engines unchanged."""

    # The collector's OTLP endpoint, as OTEL_EXPORTER_OTLP_ENDPOINT takes it: grpc
    # http(s)://host:port; http/protobuf a base URL, to which /v1/traces is appended.
    # http:// sends in plaintext, https:// over TLS.
    endpoint: str = ""
    protocol: Literal["grpc", "http/protobuf"] = "grpc"
    # share of the traces the router starts that are recorded (a client's traceparent decides
    # for its own: ParentBased(TraceIdRatioBased), the SDK's parentbased_traceidratio); 1, as the
    # SDK's own default sampler: every request, which tail sampling in a collector needs
    sampling_ratio: float = 1.0
    service_name: str = "pd-router"
    # OTLP headers (a backend's API key) from a file, e.g. a mounted Secret:
    # key=value,key2=value2 as OTEL_EXPORTER_OTLP_HEADERS takes them; "" = none
    headers_file: str = ""
    # one export call, retries included (the SDK exporter's timeout)
    timeout_seconds: float = 10.0


@dataclass(frozen=True)
class RemoteModel:
    """Another release's router that this one fronts (pd_router.remotes): requests that name
    ``name`` (or one of the adapters or KV revisions that router lists under it) are relayed
    to ``url``, the base URL of that release's router Service."""

    name: str = ""
    url: str = ""


@dataclass(frozen=True)
class RouterConfig:
    listen: Listen = field(default_factory=Listen)
    model: Model = field(default_factory=Model)
    # other base models, each served by its own release (docs/lora.md "Several base models")
    remote_models: list[RemoteModel] = field(default_factory=list)
    routing: Routing = field(default_factory=Routing)
    pools: Pools = field(default_factory=Pools)
    lmcache: LMCache = field(default_factory=LMCache)
    timeouts: Timeouts = field(default_factory=Timeouts)
    health: Health = field(default_factory=Health)
    limits: Limits = field(default_factory=Limits)
    auth: Auth = field(default_factory=Auth)
    logging: Logging = field(default_factory=Logging)
    tracing: Tracing = field(default_factory=Tracing)


# --------------------------------------------------------------------------- helpers


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__}")
        (item_tp,) = get_args(tp)
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected boolean, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = _hints(cls)
    by_key = {_camel(f.name): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        f = by_key.get(key) if isinstance(key, str) else None
        if f is None:
            allowed = ", ".join(sorted(by_key))
            raise ConfigError(f"{dotted}: unknown field (allowed here: {allowed})")
        kwargs[f.name] = _convert(value, hints[f.name], dotted)
    return cls(**kwargs)


def _set_path(data: dict[str, Any], cls: type, parts: list[str], raw: str, env_key: str) -> None:
    """Apply one env override onto the raw mapping, resolving keys case-insensitively."""
    node: dict[str, Any] = data
    cur_cls: Any = cls
    dotted: list[str] = []
    for i, part in enumerate(parts):
        fields_by_lower = {_camel(f.name).lower(): f for f in dataclasses.fields(cur_cls)}
        f = fields_by_lower.get(part.lower())
        if f is None:
            where = ".".join([*dotted, part.lower()])
            raise ConfigError(f"{where}: unknown field (from env {env_key})")
        key = _camel(f.name)
        dotted.append(key)
        if i == len(parts) - 1:
            try:
                node[key] = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError as exc:
                msg = f"{'.'.join(dotted)}: env {env_key} is not valid YAML: {exc}"
                raise ConfigError(msg) from exc
            return
        sub_cls = _hints(cur_cls)[f.name]
        if not dataclasses.is_dataclass(sub_cls):
            raise ConfigError(f"{'.'.join(dotted)}: is not a section (from env {env_key})")
        child = node.get(key)
        if child is None:
            child = {}
            node[key] = child
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(dotted)}: expected a mapping, got {child!r}")
        node = child
        cur_cls = sub_cls


_URL_RE = re.compile(r"^https?://[^\s/]+(:\d+)?/?$")
_OTLP_GRPC_RE = re.compile(r"^https?://[^\s/?#]+/?$")  # gRPC takes no path
_OTLP_HTTP_RE = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
_HUB_ENDPOINT_RE = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")  # a mirror may have a path
_HUB_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _check_port(value: int, path: str, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise ConfigError(f"{path}: port must be between {low} and 65535, got {value}")


def _positive(value: float, path: str) -> None:
    # `not value > 0` also refuses NaN; inf would mean "no timeout", which nothing here allows
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{path}: must be a finite number > 0, got {value}")


def _validate_tokenizer_hub(model: Model) -> None:
    hub = model.tokenizer_hub
    base = "model.tokenizerHub"
    if not hub.repo:
        return
    if model.tokenizer:
        raise ConfigError(
            f"{base}.repo: set either model.tokenizer (a local file) or {base}.repo, not both"
        )
    if not _HUB_REPO_RE.match(hub.repo) or ".." in hub.repo:
        raise ConfigError(f"{base}.repo: expected a model id such as 'org/name', got {hub.repo!r}")
    if not hub.revision or any(c.isspace() for c in hub.revision):
        raise ConfigError(
            f"{base}.revision: expected a branch, tag or commit, got {hub.revision!r}"
        )
    if not _HUB_ENDPOINT_RE.match(hub.endpoint):
        raise ConfigError(
            f"{base}.endpoint: expected http(s)://host[:port][/path], got {hub.endpoint!r}"
        )
    _positive(hub.timeout_seconds, f"{base}.timeoutSeconds")


def _validate_tracing(t: Tracing) -> None:
    if not 0 <= t.sampling_ratio <= 1:  # NaN fails both
        raise ConfigError(f"tracing.samplingRatio: must be between 0 and 1, got {t.sampling_ratio}")
    if not t.service_name:
        raise ConfigError("tracing.serviceName: must not be empty")
    _positive(t.timeout_seconds, "tracing.timeoutSeconds")
    if not t.endpoint:
        return
    if t.protocol == "grpc" and not _OTLP_GRPC_RE.match(t.endpoint):
        raise ConfigError(
            f"tracing.endpoint: expected http(s)://host:port for protocol grpc, got {t.endpoint!r}"
        )
    if not _OTLP_HTTP_RE.match(t.endpoint):
        raise ConfigError(
            "tracing.endpoint: expected an http(s):// URL (the base: /v1/traces is appended), "
            f"got {t.endpoint!r}"
        )


def _validate_goodput(cfg: RouterConfig) -> None:
    g = cfg.routing.goodput
    for name in ("ttft_seconds", "itl_seconds", "window_seconds"):
        _positive(getattr(g, name), f"routing.goodput.{_camel(name)}")
    if not (g.ttft_seconds_per_kilo_token >= 0 and math.isfinite(g.ttft_seconds_per_kilo_token)):
        raise ConfigError(
            "routing.goodput.ttftSecondsPerKiloToken: must be a finite number >= 0, "
            f"got {g.ttft_seconds_per_kilo_token}"
        )
    for f in dataclasses.fields(GoodputSeed):
        v = getattr(g.seed, f.name)
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(
                f"routing.goodput.seed.{_camel(f.name)}: must be a finite number >= 0 "
                f"(0 = the built-in prior), got {v}"
            )


# an adapter's name as the chart's schema takes it (model.lora.adapters[].name): no "@" (the
# revisions' names), "=" or "," (vLLM's name=path form of --lora-modules)
_ADAPTER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


def _validate_adapters(cfg: RouterConfig) -> None:
    names = cfg.model.adapters
    for i, name in enumerate(names):
        field_ = f"model.adapters[{i}]"
        if not _ADAPTER_RE.fullmatch(name):
            raise ConfigError(
                f"{field_}: an adapter name is 1-128 letters, digits and . _ / - (starting with a "
                f"letter or digit), got {name[:64]!r}"
            )
        if name == cfg.model.served_name:
            raise ConfigError(f"{field_}: {name!r} is model.servedName; an adapter needs its own")
        if name in names[:i]:
            raise ConfigError(f"{field_}: {name!r} is listed twice")
    conn = connectors.CONNECTORS[cfg.routing.connector]
    if names and conn.no_lora:
        able = connectors.names_where(lambda c: not c.no_lora)
        raise ConfigError(
            f"model.adapters: routing.connector {cfg.routing.connector!r} cannot serve LoRA "
            f"adapters ({conn.no_lora}); use {able}"
        )


def _validate_remote_models(cfg: RouterConfig) -> None:
    own = {a: "model.adapters" for a in cfg.model.adapters}
    own[cfg.model.served_name] = "model.servedName"
    seen: dict[str, int] = {}
    for i, r in enumerate(cfg.remote_models):
        base = f"remoteModels[{i}]"
        if not _ADAPTER_RE.fullmatch(r.name):
            raise ConfigError(
                f"{base}.name: a model name is 1-128 letters, digits and . _ / - (starting "
                f"with a letter or digit), got {r.name[:64]!r}"
            )
        if r.name in own:
            raise ConfigError(f"{base}.name: {r.name!r} is this router's own {own[r.name]}")
        if r.name in seen:
            raise ConfigError(f"{base}.name: {r.name!r} is remoteModels[{seen[r.name]}]'s too")
        seen[r.name] = i
        if not _URL_RE.match(r.url):
            raise ConfigError(
                f"{base}.url: expected http(s)://host:port (that release's router Service), "
                f"got {r.url[:200]!r}"
            )


def _validate_connector(cfg: RouterConfig) -> None:
    """What the layout and the decision need of the connector (pd_router.connectors)."""
    name = cfg.routing.connector
    conn = connectors.CONNECTORS[name]
    if cfg.pools.layout == "flexible" and conn.fixed_roles:
        able = connectors.names_where(lambda c: not c.fixed_roles)
        raise ConfigError(
            f"pools.layout: flexible needs routing.connector {able} ({conn.fixed_roles}), "
            f"got connector {name!r}"
        )
    if cfg.routing.decision == "goodput" and not conn.goodput:
        able = connectors.names_where(lambda c: c.goodput)
        raise ConfigError(
            f"routing.decision: goodput needs routing.connector {able} (it names the prefiller "
            f"and the decoder of each hand-off), got connector {name!r}"
        )


def _validate(cfg: RouterConfig) -> None:
    """Every field's bounds; each error names its field."""
    _validate_listen(cfg)
    if not cfg.model.served_name:
        raise ConfigError("model.servedName: must not be empty")
    _validate_tokenizer_hub(cfg.model)
    _validate_adapters(cfg)
    _validate_remote_models(cfg)
    _validate_routing(cfg)
    _validate_goodput(cfg)
    _validate_connector(cfg)
    _validate_pools(cfg.pools)
    _validate_lmcache(cfg.lmcache)
    _validate_timeouts_and_health(cfg)
    _validate_limits(cfg.limits)
    _validate_tracing(cfg.tracing)


def _validate_listen(cfg: RouterConfig) -> None:
    _check_port(cfg.listen.port, "listen.port", allow_zero=True)
    if not 0 <= cfg.listen.workers <= MAX_WORKERS:
        raise ConfigError(
            f"listen.workers: must be between 0 (one per CPU) and {MAX_WORKERS}, "
            f"got {cfg.listen.workers}"
        )
    if cfg.listen.workers > 1 and router_binds_notifications(cfg):
        raise ConfigError(
            "listen.workers: must be 1 with lmcache.notificationReceiver router (one process "
            "binds the notification socket); use notificationReceiver prefillSidecar to run "
            f"several, got {cfg.listen.workers}"
        )


def router_binds_notifications(cfg: RouterConfig) -> bool:
    """The router process itself binds the socket the prefillers notify (lmcache.notifyPort):
    one worker only."""
    notified = connectors.CONNECTORS[cfg.routing.connector].notifications
    return notified and cfg.lmcache.notification_receiver == "router"


def _validate_routing(cfg: RouterConfig) -> None:
    if cfg.routing.threshold < 0:
        raise ConfigError(f"routing.threshold: must be >= 0, got {cfg.routing.threshold}")
    pc, pb = cfg.routing.prefix_cache, cfg.routing.prefill_busy
    if pc.capacity_tokens < 1:
        raise ConfigError(
            f"routing.prefixCache.capacityTokens: must be >= 1, got {pc.capacity_tokens}"
        )
    if pc.max_load_imbalance < 0:
        raise ConfigError(
            f"routing.prefixCache.maxLoadImbalance: must be >= 0, got {pc.max_load_imbalance}"
        )
    if pb.queued_tokens < 0:
        raise ConfigError(f"routing.prefillBusy.queuedTokens: must be >= 0, got {pb.queued_tokens}")
    if pb.max_decoder_requests < 1:
        raise ConfigError(
            f"routing.prefillBusy.maxDecoderRequests: must be >= 1, got {pb.max_decoder_requests}"
        )
    ke = cfg.routing.kv_events
    _check_port(ke.port, "routing.kvEvents.port", allow_zero=True)
    _check_port(ke.replay_port, "routing.kvEvents.replayPort", allow_zero=True)
    hdr = cfg.routing.session_affinity_header
    if hdr and not re.fullmatch(HEADER_NAME_RE, hdr):
        raise ConfigError(f"routing.sessionAffinityHeader: not a valid header name: {hdr!r}")


def _validate_pools(pools: Pools) -> None:
    for pool_name in ("prefill", "decode"):
        pool: Pool = getattr(pools, pool_name)
        base = f"pools.{pool_name}"
        for i, url in enumerate(pool.static):
            if not _URL_RE.match(url):
                raise ConfigError(f"{base}.static[{i}]: expected http(s)://host:port, got {url!r}")
        if pool.discovery == "static" and not pool.static:
            raise ConfigError(f"{base}.static: must list at least one URL when discovery is static")
        if pool.discovery == "dns" and not pool.dns.name:
            raise ConfigError(f"{base}.dns.name: must be set when discovery is dns")
        _check_port(pool.dns.port, f"{base}.dns.port")
        _positive(pool.dns.refresh_seconds, f"{base}.dns.refreshSeconds")


def _validate_lmcache(lm: LMCache) -> None:
    _check_port(lm.notify_port, "lmcache.notifyPort")
    if lm.notifications_per_request < 1:
        raise ConfigError("lmcache.notificationsPerRequest: must be >= 1")
    if not lm.decoder_init_ports:
        raise ConfigError("lmcache.decoderInitPorts: must list one port per decoder TP rank")
    if len(lm.decoder_init_ports) != len(lm.decoder_alloc_ports):
        raise ConfigError(
            "lmcache.decoderAllocPorts: must have as many entries as lmcache.decoderInitPorts"
        )
    for i, p in enumerate(lm.decoder_init_ports):
        _check_port(p, f"lmcache.decoderInitPorts[{i}]")
    for i, p in enumerate(lm.decoder_alloc_ports):
        _check_port(p, f"lmcache.decoderAllocPorts[{i}]")
    _positive(lm.notify_timeout_seconds, "lmcache.notifyTimeoutSeconds")
    _check_port(lm.sidecar_port, "lmcache.sidecarPort")
    if lm.notification_receiver == "prefillSidecar":
        # the sidecar's own bounds (GET /v1/notifications/{req_id}?count=..&timeout=..)
        if lm.notifications_per_request > SIDECAR_MAX_COUNT:
            raise ConfigError(
                f"lmcache.notificationsPerRequest: must be <= {SIDECAR_MAX_COUNT} with "
                "notificationReceiver prefillSidecar"
            )
        if lm.notify_timeout_seconds > SIDECAR_MAX_TIMEOUT:
            raise ConfigError(
                f"lmcache.notifyTimeoutSeconds: must be <= {SIDECAR_MAX_TIMEOUT} with "
                "notificationReceiver prefillSidecar"
            )


def _validate_timeouts_and_health(cfg: RouterConfig) -> None:
    for f in dataclasses.fields(Timeouts):
        _positive(getattr(cfg.timeouts, f.name), f"timeouts.{_camel(f.name)}")
    h = cfg.health
    if not h.path.startswith("/"):
        raise ConfigError(f"health.path: must start with '/', got {h.path!r}")
    for name in ("interval_seconds", "timeout_seconds", "ejection_seconds", "max_ejection_seconds"):
        _positive(getattr(h, name), f"health.{_camel(name)}")
    if not math.isfinite(h.stall_seconds) or h.stall_seconds < 0:
        raise ConfigError(f"health.stallSeconds: must be >= 0 (0 = off), got {h.stall_seconds}")
    if h.max_ejection_seconds < h.ejection_seconds:
        raise ConfigError(
            f"health.maxEjectionSeconds: must be >= health.ejectionSeconds ({h.ejection_seconds}),"
            f" got {h.max_ejection_seconds}"
        )
    for name in ("healthy_threshold", "unhealthy_threshold", "passive_failure_threshold"):
        if getattr(h, name) < 1:
            raise ConfigError(f"health.{_camel(name)}: must be >= 1")


def _validate_limits(li: Limits) -> None:
    if li.max_in_flight < 1:
        raise ConfigError("limits.maxInFlight: must be >= 1")
    if li.max_queued < 0:
        raise ConfigError("limits.maxQueued: must be >= 0")
    _positive(li.queue_timeout_seconds, "limits.queueTimeoutSeconds")
    if li.max_body_bytes < MIN_MAX_BODY_BYTES:
        raise ConfigError(f"limits.maxBodyBytes: must be >= {MIN_MAX_BODY_BYTES}")
    if li.max_headers < MIN_MAX_HEADERS:
        raise ConfigError(f"limits.maxHeaders: must be >= {MIN_MAX_HEADERS}")


def parse_config(data: Any, env: Mapping[str, str] | None = None) -> RouterConfig:
    """Validate an already-parsed mapping (plus env overrides) into a RouterConfig."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"<root>: expected a mapping, got {type(data).__name__}")
    raw: dict[str, Any] = _deep_copy(data)
    for key in sorted((env or {}).keys()):
        if not key.upper().startswith(ENV_PREFIX):
            continue
        parts = [p for p in key[len(ENV_PREFIX) :].split("__")]
        if not parts or any(not p for p in parts):
            raise ConfigError(f"<env>: malformed override name {key!r}")
        _set_path(raw, RouterConfig, parts, (env or {})[key], key)
    cfg = _build(RouterConfig, raw, "")
    pools = raw.get("pools")
    if cfg.pools.layout == "flexible" and isinstance(pools, Mapping) and "prefill" in pools:
        raise ConfigError(
            "pools.prefill: not used with pools.layout flexible (every engine is in "
            "pools.decode and takes either part); remove it"
        )
    _validate(cfg)
    return cfg


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> RouterConfig:
    """Load and validate the router config file.

    ``env`` defaults to no overrides; pass ``os.environ`` to honour ``PD_ROUTER__*`` variables.
    Raises ConfigError (message names the dotted field path) on any problem.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"<file>: cannot read config file {p}: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"<file>: {p} is not valid YAML: {exc}") from exc
    if data is None:  # an empty or mis-mounted file must not start a router on all defaults
        raise ConfigError(f"<file>: {p} is empty (no settings); the chart renders a full config")
    return parse_config(data, env)


def to_dict(cfg: Any) -> Any:
    """Render a config (or section) back to the camelCase mapping form."""
    if dataclasses.is_dataclass(cfg):
        return {_camel(f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    return cfg
