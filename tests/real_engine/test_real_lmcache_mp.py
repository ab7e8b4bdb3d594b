"""LMCache's multi-process (MP) mode beside the NIXL hand-off (kvTransfer.nixl.lmcacheMp), on the
real packages: the dev environment's engines as the chart renders them with it (vLLM's
MultiConnector of NixlConnector and LMCacheMPConnector, engine-driven) and each pod's
``lmcache-server`` container as a process of LMCache 0.5.6 (tests/real_engine/engines.py
``LMCacheServer``), the dev environment's router (the MP mode changes nothing in it).

- Long prompts through the router are disaggregated over NIXL (the decoder computes none of
  the prompt) and each answer equals the decoder's own, token for token; the prefiller's
  LMCache server stores their full chunks meanwhile.
- LMCache serves what vLLM no longer holds: a prompt served whole on the decoder, its prefix
  cache then emptied (vLLM's ``/reset_prefix_cache``, on in dev mode), is asked again: its full
  chunks come from the decoder's LMCache server (``external_kv_transfer``) and the answer is
  the same. The first ask is the negative control (nothing to load).

Measured on 2026-12-07 (``pytest -s tests/real_engine/test_real_lmcache_mp.py``, vLLM 0.31.0's CPU
build, LMCache 0.5.6, chunk 256): printed by the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.prompts import ask, colocated, text
from tests.real_engine.routers import Routers

RENDER = "env:dev lmcache-mp"
CHUNK = 256  # the render's kvTransfer.nixl.lmcacheMp.chunkSize (tests/values/lmcache-mp.yaml: the default)
WORDS = (300, 520, 700)  # about 600 to 1,400 tokens: past the dev threshold (512)


def objects(e: engines.Engine) -> int:
    """The chunks ``e``'s LMCache server holds (its ``/status``, LMCache 0.5.6 info_api)."""
    assert e.server is not None
    return int(e.server.status()["storage_manager"]["l1_manager"]["total_object_count"])


@pytest.fixture(scope="module")
def mp(pairs: Pairs, workdir: Path) -> Iterator[dict[str, engines.Engine]]:
    pairs.stop()  # one pair at a time (Pairs): this one needs vLLM's dev mode besides
    pair = {
        role: engines.engine(role, "dense", core, workdir, render=RENDER, env_extra={"VLLM_SERVER_DEV_MODE": "1"})
        for role, core in (("prefill", 0), ("decode", 1))
    }
    assert all(e.server is not None for e in pair.values()), "the render runs no LMCache server"
    with engines.running(list(pair.values())):
        yield pair


@pytest.fixture(scope="module")
def router(mp: dict[str, engines.Engine], routers: Routers) -> Iterator[Proc]:
    # the dev environment's router: LMCache's MP mode changes nothing in it (the route is NIXL's)
    r = routers.start([mp["prefill"].url], [mp["decode"].url])
    try:
        yield r
    finally:
        r.stop()


def test_lmcache_mp_handoffs_over_nixl_equal_colocated_and_the_prefiller_stores_chunks(
    mp: dict[str, engines.Engine], router: Proc, model_name: str
) -> None:
    pre, dec = mp["prefill"], mp["decode"]
    stored0, chunks = objects(pre), 0
    for i, words in enumerate(WORDS):
        prompt = text(f"lmcache-mp-{i}", words)
        base = colocated(dec.url, model_name, True, prompt)
        before = engines.by_source(dec)
        got = ask(router.url(), model_name, True, prompt, bool(i % 2))
        after = engines.by_source(dec)
        moved = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        print(
            f"\n{base.prompt_tokens} tokens: {got.route}, moved {moved:.0f}, computed {computed:.0f}, equal {got.text == base.text}"
        )
        assert (got.route, got.reason) == ("disaggregated", "above_threshold"), got
        assert got.text == base.text and got.prompt_tokens == base.prompt_tokens, (got, base)
        assert moved == base.prompt_tokens and computed == 0, (moved, computed)
        chunks += (base.prompt_tokens or 0) // CHUNK
    stored = objects(pre) - stored0
    print(f"prefiller's LMCache server: {stored} chunks stored for {chunks} full chunks prompted")
    for role, e in mp.items():  # what kvTransfer.nixl.lmcacheMp.overheadGiB must hold beside the L1
        assert e.server is not None
        print(
            f"{role}'s LMCache server: peak RSS {e.server.peak_rss_bytes() / 2**30:.2f} GiB (L1 {engines.KV_CACHE_GIB} GiB)"
        )
    assert stored == chunks > 0


def test_lmcache_mp_serves_what_vllm_no_longer_holds(mp: dict[str, engines.Engine], model_name: str) -> None:
    dec = mp["decode"]
    prompt = text("lmcache-mp-reload", 550)
    before = engines.by_source(dec)
    first = ask(dec.url, model_name, True, prompt, False)
    mid = engines.by_source(dec)
    assert mid["external_kv_transfer"] == before["external_kv_transfer"], "nothing to load the first time"
    status, body, _ = engines.post(dec.url, "/reset_prefix_cache", {})
    assert status == 200, body
    again = ask(dec.url, model_name, True, prompt, False)
    after = engines.by_source(dec)
    loaded = after["external_kv_transfer"] - mid["external_kv_transfer"]
    computed = after["local_compute"] - mid["local_compute"]
    full = (first.prompt_tokens or 0) // CHUNK * CHUNK
    print(f"\n{first.prompt_tokens} tokens asked again: {loaded:.0f} loaded from LMCache, {computed:.0f} computed")
    assert again.text == first.text
    assert loaded == full > 0 and computed == (first.prompt_tokens or 0) - full, (loaded, computed)
