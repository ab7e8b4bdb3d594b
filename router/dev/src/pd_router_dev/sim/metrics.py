"""The engine's ``vllm:*`` Prometheus metrics as vLLM 0.31.0 exports them.

Names, types, help texts, label names (``model_name``, ``engine``, plus the extra label of a
few) and histogram buckets from ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``)
and ``vllm/v1/metrics/buckets.py``; what is observed when, from ``vllm/v1/metrics/stats.py``
(``IterationStats``, ``update_from_finished_request``) and ``vllm/v1/engine/output_processor.py``
(a client abort is never a finished request). A NIXL engine also exports the NixlConnector's
metrics (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py``, ``NixlPromMetrics``;
0.33 adds ``vllm:nixl_num_notifications_after_expiry``). Same ``prometheus_client`` library
as vLLM, so the exposition format (``_total``/``_created`` samples, label order) is its own.

``vllm:cache_config_info`` carries the labels vLLM 0.31.0's ``CacheConfig.metrics_info`` gives
(as its CPU build exports them), with the simulator's own block size and capacity: the router
reads its block size there, as it does from a real engine.

Not exported: vLLM's HTTP-server metrics (prometheus_fastapi_instrumentator), process
metrics, speculative-decoding, LoRA, multimodal-cache contents and 0.33's new core metrics.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# vllm/v1/metrics/buckets.py (0.31)
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N = (1, 2, 5, 10, 20)
PREEMPTIONS = (1, 2, 3, 4, 5, 10, 20)
# vllm/v1/engine/__init__.py FINISH_REASON_STRINGS (0.31)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# The simulated model, for the work it is estimated to do (vllm:estimated_*_per_gpu): Llama-3.3-
# 70B's parameters, and its KV cache per token (2 x 80 layers x 8 KV heads x 128 x 2 bytes),
# which also gives the simulated NIXL transfers their size (vllm:nixl_bytes_transferred)
MODEL_PARAMS = 70.6e9
KV_BYTES_PER_TOKEN = 327680


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """buckets.py build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ..."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


class _Child:
    """One labelled series; plain attributes, so a token costs an addition, not a lock
    (the sequence hot path records several per token)."""

    __slots__ = ("bounds", "counts", "created", "sum", "value")

    def __init__(self, bounds: tuple[float, ...] | None = None) -> None:
        self.value = 0.0
        self.created = time.time()
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1) if bounds is not None else []
        self.sum = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def observe(self, value: float) -> None:
        assert self.bounds is not None
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value


class _Family:
    def __init__(
        self,
        kind: str,
        name: str,
        doc: str,
        labelnames: list[str],
        buckets: Any = None,
    ) -> None:
        self.kind = kind
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        self.bounds = tuple(float(b) for b in buckets) if buckets is not None else None
        self.children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *values: str) -> _Child:
        key = tuple(str(v) for v in values)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = _Child(self.bounds)
        return child

    def collect(self) -> Metric:
        if self.kind == "gauge":
            g = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
            for key, c in self.children.items():
                g.add_metric(key, c.value)
            return g
        if self.kind == "counter":
            m = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for key, c in self.children.items():
                m.add_metric(key, c.value, created=c.created)
            return m
        h = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        assert self.bounds is not None
        for key, c in self.children.items():
            acc = 0
            buckets = []
            for bound, n in zip((*self.bounds, float("inf")), c.counts, strict=True):
                acc += n
                buckets.append((floatToGoString(bound), acc))
            h.add_metric(key, buckets, c.sum)
            labels = dict(zip(self.labelnames, key, strict=True))
            h.samples.append(Sample(self.name + "_created", labels, c.created))
        return h


class _Collector:
    def __init__(self) -> None:
        self.families: list[_Family] = []

    def add(self, fam: _Family) -> _Family:
        self.families.append(fam)
        return fam

    def collect(self) -> Any:
        for fam in self.families:
            yield fam.collect()


# vllm:cache_config_info's labels, in vLLM 0.31.0's order, with the values a default engine
# shows (read off its CPU build); VllmMetrics sets those the simulator decides.
CACHE_CONFIG_INFO = {
    "_block_size_resolved": "True", "block_size": "16", "cache_dtype": "auto",
    "effective_attention_block_size": "16", "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True", "engine": "0", "gpu_memory_utilization": "0.92",
    "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
    "kv_cache_max_concurrency": "None", "kv_cache_memory_bytes": "None",
    "kv_cache_size_tokens": "None", "kv_offloading_backend": "native",
    "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
    "mamba_cache_dtype": "auto", "mamba_cache_mode": "none", "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "float32", "num_cpu_blocks": "None", "num_gpu_blocks": "None",
    "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None",
    "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
    "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
    "user_specified_block_size": "False", "user_specified_mamba_block_size": "False",
}  # fmt: skip


class VllmMetrics:
    def __init__(
        self,
        model: str,
        max_model_len: int,
        kv_connector: str,
        version: str,
        cache: dict[str, str] | None = None,
    ) -> None:
        """``cache``: vllm:cache_config_info labels to set over CACHE_CONFIG_INFO."""
        self.registry = CollectorRegistry()
        col = _Collector()
        self.registry.register(col)  # type: ignore[arg-type]  # a collector, not a metric
        names = ["model_name", "engine"]
        lv = (model, "0")

        def gauge_family(name: str, doc: str, labelnames: list[str]) -> _Family:
            return col.add(_Family("gauge", name, doc, labelnames))

        def counter_family(name: str, doc: str, labelnames: list[str]) -> _Family:
            return col.add(_Family("counter", name, doc, labelnames))

        def gauge(name: str, doc: str) -> _Child:
            return gauge_family(name, doc, names).labels(*lv)

        def counter(name: str, doc: str) -> _Child:
            return counter_family(name, doc, names).labels(*lv)

        def hist(name: str, doc: str, buckets: Any) -> _Child:
            return col.add(_Family("histogram", name, doc, names, buckets)).labels(*lv)

        info = {**CACHE_CONFIG_INFO, **(cache or {})}
        gauge_family(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info)
        ).labels(*info.values()).set(1)
        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        by_reason = gauge_family(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*names, "reason"],
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        by_reason.labels(*lv, "deferred")
        sleep = gauge_family(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            [*names, "sleep_state"],
        )
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded")
        sleep.labels(*lv, "discard_all")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # the local prefix cache (engine.py PrefixCache): per admitted request its prompt
        # length and its cache hit, in tokens (stats.py PrefixCacheStats.record, 0.31)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.ext_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        self.ext_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
        )
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = counter_family(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*names, "source"],
        )
        self.prompt_by_source = {s: by_source.labels(*lv, s) for s in PROMPT_SOURCES}
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        # v1/metrics/perf.py PerfMetricsProm (0.31 and 0.33; the CPU build exports them at 0):
        # here 2 x MODEL_PARAMS FLOPs per token computed, the KV of the tokens it attends to
        # read and of the tokens computed written (weights' reads, shared by a step's batch,
        # left out); see :meth:`work`
        mfu = " (for Model Flops Utilization calculations)."
        self.est_flops = counter(
            "vllm:estimated_flops_per_gpu",
            "Estimated number of floating point operations per GPU" + mfu,
        )
        self.est_read = counter(
            "vllm:estimated_read_bytes_per_gpu",
            "Estimated number of bytes read from memory per GPU" + mfu,
        )
        self.est_write = counter(
            "vllm:estimated_write_bytes_per_gpu",
            "Estimated number of bytes written to memory per GPU" + mfu,
        )
        success = counter_family(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
        )
        self.success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        tok_b = request_tokens_buckets(max_model_len)
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok_b
        )
        self.req_gen = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok_b
        )
        self.iteration = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS,
        )
        self.max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tok_b,
        )
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N
        )
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tok_b,
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY,
        )
        self.preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTIONS,
        )
        self.kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tok_b,
        )
        self.nixl: dict[str, Any] = {}
        if kv_connector == "nixl":
            self._nixl(hist, counter, version)

    def _nixl(self, hist: Any, counter: Any, version: str) -> None:
        b = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
        x = self.nixl
        x["xfer_time"] = hist(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            b[1:],
        )
        x["post_time"] = hist(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            b,
        )
        x["bytes"] = hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            [2 ** (10 + i) for i in range(1, 25, 2)],
        )
        x["descriptors"] = hist(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000),
        )
        x["failed_transfers"] = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification "
            "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        )
        x["failed_notifications"] = counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications. Retained for compatibility; these "
            "failures are also included in vllm:nixl_num_failed_transfers.",
        )
        x["kv_expired"] = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the "
            "P instance.",
        )
        if version == "0.33":
            x["after_expiry"] = counter(
                "vllm:nixl_num_notifications_after_expiry",
                "Number of completion notifications for requests that were no longer tracked, "
                "usually because their KV lease expired. The KV blocks may have been reused "
                "before the transfer finished. Counted per notification (one per remote rank), "
                "not per request.",
            )

    def work(self, computed: int, context: int) -> None:
        """``computed`` tokens computed in one step of a sequence with ``context`` tokens."""
        self.est_flops.inc(2 * MODEL_PARAMS * computed)
        self.est_read.inc(KV_BYTES_PER_TOKEN * context)
        self.est_write.inc(KV_BYTES_PER_TOKEN * computed)

    def render(self) -> bytes:
        return generate_latest(self.registry)
