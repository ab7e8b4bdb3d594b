"""What an engine says about its own KV cache, read once from its ``/metrics``: vLLM's
``vllm:cache_config_info`` gauge, whose labels are the engine's resolved ``CacheConfig``
(``v1/metrics/loggers.py`` ``log_metrics_info``; ``config/cache.py`` ``metrics_info``, checked
in vLLM 0.31.0, its CPU build and 0.33.0).

The router needs it because vLLM, not the chart, decides a model's block size: 16 tokens by
default on GPUs, 128 on the CPU build, and for a hybrid model (Qwen3.5, other Mamba or
linear-attention mixes) raised until an attention page holds a Mamba state
(``platforms/interface.py`` ``_align_hybrid_block_size``), often hundreds of tokens, even over
a ``--block-size`` the user set. A prefix-cache hit covers whole blocks (or whole
``prefix_match_unit`` tokens where that is set), so the router rounds what it believes a decoder
holds down to that unit, and claims nothing of an engine that did not say.

A hybrid model's prefix is reusable only where vLLM checkpointed its linear-attention state
(``mamba_cache_mode`` ``align``: at block boundaries a scheduled chunk ended on), which the
router cannot tell from the prompts it sent. Measured on vLLM 0.31.0's CPU build with a tiny
Qwen3.5-style model (tests/real_engine/test_real_hybrid.py): a conversation's next turn reused
nothing in one run and two 256-token blocks in another, the very same prompt again reused nothing
after a direct turn and three blocks after a disaggregated one. So the approximate index claims
nothing of a hybrid engine's cache (``hybrid``); the engines' KV-cache events tell
(pd_router.kv_events).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METRIC = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class CacheInfo:
    block_size: int  # tokens per KV block of the attention layers
    match_unit: int  # the finest boundary a prefix-cache hit lands on (hash_block_size)
    prefix_caching: bool  # enable_prefix_caching: off, nothing is ever reused
    capacity_tokens: int | None  # kv_cache_size_tokens: what the whole cache holds
    hybrid: bool = False  # a Mamba/linear-attention state cache beside the KV (mamba_cache_mode)


def _int(labels: dict[str, str], key: str) -> int | None:
    v = labels.get(key, "")
    return int(v) if v.isdigit() and int(v) > 0 else None


def parse(text: str) -> CacheInfo | None:
    """The first ``vllm:cache_config_info`` sample of a Prometheus text page, or None when there
    is none or it names no block size."""
    for line in text.splitlines():
        if not line.startswith(METRIC + "{"):
            continue
        labels = dict(_LABEL.findall(line[len(METRIC) : line.rfind("}") + 1]))
        block = _int(labels, "block_size")
        if block is None:
            return None
        unit = _int(labels, "prefix_match_unit") or block
        caching = labels.get("enable_prefix_caching", "True") == "True"
        hybrid = labels.get("mamba_cache_mode", "none") not in ("none", "None", "")
        return CacheInfo(block, unit, caching, _int(labels, "kv_cache_size_tokens"), hybrid)
    return None
