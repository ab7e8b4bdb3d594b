"""The simulator's automatic prefix caching (sim/engine.py ``PrefixCache``), as vLLM 0.31.0's v1
KV cache manager does it: full 16-token blocks hashed in a chain, the longest cached prefix
reused at admission but never the prompt's last token, only the rest computed (and charged to
the step), blocks cached as their tokens are scheduled (generated ones too, and what a KV
connector delivered), LRU eviction with a finished request's tail blocks first,
``vllm:prefix_cache_queries``/``vllm:prefix_cache_hits`` in tokens.

In-process engines on loopback (aiohttp's test server); the step loop's sleep is recorded, not
slept, so nothing depends on wall-clock time. Not in the repository's pytest ``testpaths``:
run ``pytest router/dev/tests``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pd_router_dev.sim import model as M
from pd_router_dev.sim.__main__ import parse_args
from pd_router_dev.sim.server import SimConfig, SimEngine, build_app

MODEL = "llama-3.3-70b"
CMPL = "/v1/completions"
ROOT = Path(__file__).resolve().parents[3]
VLLM = (
    Path(os.environ.get("PD_ENGINE_STACK", ROOT / ".tools" / "engine-stack"))
    / "vllm-0.31.0"
    / "vllm"
)


@asynccontextmanager
async def sim(
    **cfg: Any,
) -> AsyncIterator[tuple[TestClient[web.Request, web.Application], SimEngine]]:
    app, engine = build_app(SimConfig(**cfg))
    async with TestClient(TestServer(app)) as client:
        yield client, engine


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids, distinct from the first one on for each ``seed``."""
    return [1000 + seed * 1000 + j for j in range(n)]


async def complete(
    c: TestClient[web.Request, web.Application], toks: list[int], max_tokens: int = 1, **extra: Any
) -> Any:
    body = {"prompt": toks, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    r = await c.post(CMPL, data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status == 200, await r.text()
    return await r.json()


class Scrape:
    """The engine's counters (``_total``/``_sum`` samples) at one moment."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                self.samples[(s.name, frozenset(labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]


async def scrape(c: TestClient[web.Request, web.Application]) -> Scrape:
    return Scrape(await (await c.get("/metrics")).text())


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after(name, **labels) - before(name, **labels)


QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
ITER_SUM = "vllm:iteration_tokens_total_sum"
SOURCE = "vllm:prompt_tokens_by_source_total"


async def pool(c: TestClient[web.Request, web.Application]) -> dict[str, Any]:
    r = await c.get("/sim/prefix_cache")
    assert r.status == 200
    out: dict[str, Any] = await r.json()
    return out


# ----------------------------------------------------------------------- (a) the same prompt
def test_a_repeated_prompt_hits_its_full_blocks_but_never_its_last_token() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            p = prompt(1, 100)  # 6 full blocks (96 tokens) and 4 more
            s0 = await scrape(c)
            await complete(c, p)
            s1 = await scrape(c)
            assert (delta(s0, s1, QUERIES), delta(s0, s1, HITS)) == (100, 0)
            await complete(c, p)
            s2 = await scrape(c)
            assert (delta(s1, s2, QUERIES), delta(s1, s2, HITS)) == (100, 96)
            assert delta(s1, s2, SOURCE, source="local_cache_hit") == 96
            assert delta(s1, s2, SOURCE, source="local_compute") == 4
            assert delta(s1, s2, "vllm:prompt_tokens_cached_total") == 96
            # a prompt of whole blocks: the hit stops at num_tokens - 1, i.e. a block short
            # (kv_cache_manager.py get_computed_blocks: max_cache_hit_length)
            q = prompt(2, 64)
            await complete(c, q)
            s3 = await scrape(c)
            await complete(c, q)
            s4 = await scrape(c)
            assert (delta(s3, s4, QUERIES), delta(s3, s4, HITS)) == (64, 48)
            assert delta(s3, s4, SOURCE, source="local_compute") == 16
            assert (await pool(c))["in_use_blocks"] == 0  # every block given back

    run(go)


def test_a_cached_prompt_prefills_only_its_uncached_tokens() -> None:
    """The engine's own accounting: the first step of a request (prompt tokens computed plus
    the sampled token, ``vllm:iteration_tokens_total``), the KV computed
    (``vllm:request_prefill_kv_computed_tokens``) and, on the step loop, the step's duration
    (``prefill_ms_per_token`` x tokens computed) and its token budget."""

    async def go() -> None:
        p = prompt(3, 100)
        async with sim() as (c, _):  # zero-delay engine: one step per round of tokens
            s0 = await scrape(c)
            await complete(c, p)
            s1 = await scrape(c)
            await complete(c, p)
            s2 = await scrape(c)
            assert delta(s0, s1, ITER_SUM) == 100 + 1
            assert delta(s1, s2, ITER_SUM) == 4 + 1
            fam = "vllm:request_prefill_kv_computed_tokens_sum"
            assert (delta(s0, s1, fam), delta(s1, s2, fam)) == (100, 4)
        async with sim(prefill_ms_per_token=1.0, max_num_batched_tokens=64) as (c, engine):
            steps: list[float] = []

            async def record(seconds: float) -> None:
                steps.append(round(seconds * 1000, 6))
                await asyncio.sleep(0)

            engine.engine.sleep = record
            await complete(c, p)
            assert steps == [64.0, 36.0]  # two chunks of the 64-token budget
            steps.clear()
            await complete(c, p)
            assert steps == [4.0]  # the 4 tokens past the 96 cached

    run(go)


# ----------------------------------------------------------------------- (b) shared prefixes
def test_b_a_shared_prefix_hits_only_the_shared_full_blocks() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            shared = prompt(4, 40)  # blocks 0, 1 full; block 2 (tokens 32..47) diverges
            await complete(c, shared + prompt(5, 30))
            s0 = await scrape(c)
            await complete(c, shared + prompt(6, 30))
            s1 = await scrape(c)
            assert delta(s0, s1, HITS) == 32
            # the chain: a first token of its own makes every later block a miss, even where
            # its tokens are a cached prompt's
            await complete(c, [7, *(shared + prompt(5, 30))[1:]])
            s2 = await scrape(c)
            assert delta(s1, s2, HITS) == 0

    run(go)


def test_generated_tokens_blocks_are_cached_too() -> None:
    """A follow-up turn (prompt + answer + more) reuses the answer's full blocks: 40 prompt
    tokens and 30 generated, of which the KV of all but the last was computed: 69 tokens, 4
    full blocks."""

    async def go() -> None:
        async with sim() as (c, _):
            p = prompt(8, 40)
            await complete(c, p, max_tokens=30)
            gen = M.Generator(p, ignore_eos=True)
            answer = [gen.step() for _ in range(30)]
            s0 = await scrape(c)
            await complete(c, p + answer + prompt(9, 20))
            s1 = await scrape(c)
            assert delta(s0, s1, HITS) == 64

    run(go)


def test_parallel_samples_share_the_prompts_blocks() -> None:
    """``n`` > 1: each choice is a request of its own, admitted in order in one step; the
    second finds the blocks the first's allocation just cached (allocate_slots caches at
    scheduling)."""

    async def go() -> None:
        async with sim() as (c, _):
            s0 = await scrape(c)
            await complete(c, prompt(10, 40), max_tokens=2, n=2)
            s1 = await scrape(c)
            assert (delta(s0, s1, QUERIES), delta(s0, s1, HITS)) == (80, 32)
            assert delta(s0, s1, ITER_SUM) == (40 + 8 + 2) + 2

    run(go)


# ----------------------------------------------------------------------- (c) capacity
def test_c_a_small_cache_evicts_least_recently_used_tail_blocks_first() -> None:
    """256 tokens: 16 blocks, block 0 vLLM's null block. Each 65-token prompt takes 5 blocks
    (4 full, cached, and a partial one); once finished its blocks go back to the free queue
    in reverse order, the full ones at the tail, so the next requests take the never-used
    blocks, then the partial ones, then the oldest prompt's blocks from its last one back."""

    async def go() -> None:
        async with sim(prefix_cache_tokens=256) as (c, _):
            first = prompt(11, 65)
            await complete(c, first)
            seen = [await pool(c)]
            for i in range(3):  # 15 blocks to hand out: 5 + 5 + 5, the third takes 2 of A's
                await complete(c, prompt(12 + i, 65))
                seen.append(await pool(c))
            s0 = await scrape(c)
            await complete(c, first)
            s1 = await scrape(c)
            assert delta(s0, s1, HITS) == 32  # its first 2 blocks survived, its last 2 did not
            for i in range(6):
                await complete(c, prompt(20 + i, 65))
                seen.append(await pool(c))
            s2 = await scrape(c)
            await complete(c, first)
            s3 = await scrape(c)
            assert delta(s2, s3, HITS) == 0  # evicted
            for st in seen:
                assert st["num_blocks"] == 256 // 16
                assert st["cached_blocks"] <= 256 // 16 - 1  # never more than the pool
                assert st["in_use_blocks"] == 0
            # full: every block but the null block and one partial block, which goes back to
            # the head of the free queue and so is the next request's first (LIFO)
            assert seen[-1]["cached_blocks"] == 256 // 16 - 2

    run(go)


# ----------------------------------------------------------------------- (d) off
def test_d_prefix_caching_off_never_hits() -> None:
    async def go() -> None:
        async with sim(prefix_cache_tokens=0) as (c, _):
            p = prompt(30, 100)
            s0 = await scrape(c)
            for _ in range(3):
                await complete(c, p)
            s1 = await scrape(c)
            # record_prefix_cache_stats: no lookup, no count
            assert (delta(s0, s1, QUERIES), delta(s0, s1, HITS)) == (0, 0)
            assert delta(s0, s1, SOURCE, source="local_cache_hit") == 0
            assert delta(s0, s1, ITER_SUM) == 3 * (100 + 1)
            assert await pool(c) == {"enabled": False}

    run(go)


# ----------------------------------------------------------------------- KV connectors
def test_nixl_kv_pulled_by_a_decoder_is_cached_there() -> None:
    async def go() -> None:
        async with (
            sim(kv_connector="nixl") as (pc, _),
            sim(kv_connector="nixl") as (dc, decoder),
        ):
            p = prompt(40, 100)
            got = await complete(pc, p, kv_transfer_params={"do_remote_decode": True})
            kv = got["kv_transfer_params"]
            s0 = await scrape(dc)
            await complete(dc, p, max_tokens=2, kv_transfer_params=kv)
            s1 = await scrape(dc)
            assert delta(s0, s1, SOURCE, source="external_kv_transfer") == 99
            assert delta(s0, s1, ITER_SUM) == (1 + 1) + 1
            assert (await pool(dc))["cached_blocks"] == 6  # the pulled prompt's full blocks
            await complete(dc, p)  # the same prompt, no KV handed over: a local hit
            s2 = await scrape(dc)
            assert delta(s1, s2, HITS) == 96
            assert delta(s1, s2, "vllm:external_prefix_cache_queries_total") == 4
            assert delta(s1, s2, "vllm:external_prefix_cache_hits_total") == 0
            # handed over again: only what the local hit lacks is pulled
            got = await complete(pc, p, kv_transfer_params={"do_remote_decode": True})
            await complete(dc, p, kv_transfer_params=got["kv_transfer_params"])
            s3 = await scrape(dc)
            assert delta(s2, s3, SOURCE, source="local_cache_hit") == 96
            assert delta(s2, s3, SOURCE, source="external_kv_transfer") == 3
            assert delta(s2, s3, SOURCE, source="local_compute") == 1
            fam = "vllm:nixl_bytes_transferred_sum"
            assert delta(s2, s3, fam) == 4 * delta(s0, s1, fam) / 100
            assert decoder.m["kv_remote_prefill"] == 2

    run(go)


def test_lmcache_kv_retrieved_by_a_receiver_is_cached_there() -> None:
    # the receiver's KV ports on free ones: nothing pushes to them here
    receiver = {"lmcache_role": "receiver", "pd_peer_init_port": [0], "pd_peer_alloc_port": [0]}

    async def go() -> None:
        async with sim(kv_connector="lmcache", **receiver) as (c, recv):
            p = prompt(50, 100)
            recv.kv_store[M.seq_hash(p[:-1])] = len(p)  # as the sender's push stores it
            s0 = await scrape(c)
            await complete(c, p)
            s1 = await scrape(c)
            assert delta(s0, s1, SOURCE, source="external_kv_transfer") == 99
            assert delta(s0, s1, "vllm:external_prefix_cache_hits_total") == 99
            assert delta(s0, s1, HITS) == 0
            # again, the KV still at hand: the local hit first, the connector for the rest
            await complete(c, p)
            s2 = await scrape(c)
            assert delta(s1, s2, HITS) == 96
            assert delta(s1, s2, "vllm:external_prefix_cache_queries_total") == 100 - 96
            assert delta(s1, s2, "vllm:external_prefix_cache_hits_total") == 99 - 96
            assert delta(s1, s2, SOURCE, source="local_compute") == 1
            del recv.kv_store[M.seq_hash(p[:-1])]
            await complete(c, p)  # and with the KV gone, the local cache alone
            s3 = await scrape(c)
            assert delta(s2, s3, HITS) == 96
            assert delta(s2, s3, SOURCE, source="local_compute") == 4

    run(go)


# ----------------------------------------------------------------------- (e) vLLM's names
def test_e_metric_names_are_vllms_and_exported_with_its_labels() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            text = await (await c.get("/metrics")).text()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            assert fams[name].type == "counter"
            for s in fams[name].samples:
                assert s.labels.keys() == {"model_name", "engine"}

    run(go)
    loggers = VLLM / "v1" / "metrics" / "loggers.py"
    if not loggers.is_file():
        pytest.skip(f"vLLM 0.31.0's source is not installed at {VLLM} (make engines)")
    src = loggers.read_text()
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert f'name="{name}"' in src
    # the rules the tests above hold the simulator to, where vLLM states them
    kv = (VLLM / "v1" / "core" / "kv_cache_manager.py").read_text()
    assert "max_cache_hit_length = request.num_tokens - 1" in kv
    single = (VLLM / "v1" / "core" / "single_type_kv_cache_manager.py").read_text()
    assert "self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))" in single


# ----------------------------------------------------------------------- the flag
def test_cli_flag() -> None:
    cfg, _ = parse_args([])
    assert cfg.prefix_cache_tokens == 262144 == SimConfig().prefix_cache_tokens
    pc = SimEngine(cfg).prefix_cache
    assert pc is not None and pc.num_blocks == 262144 // 16
    cfg, _ = parse_args(["--prefix-cache-tokens", "0"])
    assert cfg.prefix_cache_tokens == 0 and SimEngine(cfg).prefix_cache is None
    for bad in ("-16", "16"):
        with pytest.raises(SystemExit):
            parse_args(["--prefix-cache-tokens", bad])
