"""The chart's default model is hybrid (Qwen3.5: Gated DeltaNet linear attention beside full
attention). A tiny Qwen3.5-style model stands for it on vLLM's CPU build (bfloat16, the only dtype
its GDN kernel takes; a tie-free output head, tests/engines/harness/tiny_model.py): the NIXL
hand-off moves its attention KV and its Mamba-style state, the answers equal the decoder's own
token for token, and the router claims only whole blocks of the size vLLM chose for it (vLLM
aligns a hybrid model's attention block with its Mamba state; cache_config_info says which),
and its KV-cache events say what each KV-cache group holds."""

from __future__ import annotations

from typing import Any

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.events import STATE, metric, settle, until
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers

SOURCES = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def hybrid(pairs: Pairs) -> dict[str, engines.Engine]:
    return pairs.get("hybrid")


@pytest.fixture(scope="module")
def hybrid_router(hybrid: dict[str, engines.Engine], routers: Routers) -> Proc:
    return routers.start([hybrid["prefill"].url], [hybrid["decode"].url], kind="hybrid")


def cache_info(e: engines.Engine) -> dict[str, str]:
    ((labels, _),) = engines.samples(e.metrics(), "vllm:cache_config_info")
    return labels


def test_vllm_runs_it_as_a_hybrid_with_aligned_blocks(hybrid: dict[str, engines.Engine]) -> None:
    info = cache_info(hybrid["decode"])
    assert info["mamba_cache_mode"] == "align" and info["enable_prefix_caching"] == "True"
    assert int(info["block_size"]) % int(info["mamba_block_size"]) == 0


@pytest.mark.parametrize(("chat", "stream"), [(True, False), (True, True), (False, False), (False, True)])
def test_hybrid_answers_through_nixl_equal_colocated(
    chat: bool, stream: bool, hybrid: dict[str, engines.Engine], hybrid_router: Proc, model_name: str
) -> None:
    """The first token, the one computed from the state that came over NIXL, equals the
    decoder's own. Longer greedy answers are not compared: on this machine (2026-12-02) 5 of 13
    chat prompts' 24-token answers left the colocated one after 2 to 63 characters, also with
    the router bypassed (prefill on the prefiller, decode with its kv_transfer_params), while
    the colocated answer was the same on every ask and on both engines; the previous machine
    showed no divergence in 4 of 4. vLLM recomputes a hybrid prompt's last token on the decoder
    in bfloat16, a plausible source; not settled (docs/testing.md)."""
    dec = hybrid["decode"]
    prompt = text(f"hybrid-{chat}-{stream}", LONG_WORDS)
    base = colocated(dec.url, model_name, chat, prompt, max_tokens=1)
    before = engines.metrics_text(dec.url)
    got = ask(hybrid_router.url(), model_name, chat, prompt, stream, max_tokens=1)
    after = engines.metrics_text(dec.url)
    moved = engines.value(after, SOURCES, source="external_kv_transfer") - engines.value(
        before, SOURCES, source="external_kv_transfer"
    )
    computed = engines.value(after, SOURCES, source="local_compute") - engines.value(
        before, SOURCES, source="local_compute"
    )
    assert got.route == "disaggregated" and got.text == base.text
    # all but the prompt's last token came over NIXL (vLLM recomputes that one for a hybrid)
    assert moved + computed == base.prompt_tokens and computed <= 1, (moved, computed)


def chat_turns(router: Proc, dec: engines.Engine, live: list[engines.Engine], model: str, seed: str) -> list[tuple]:
    """Four turns of one chat through ``router``: (turn, prompt, x-pd-cached-tokens, reused,
    route, the route vLLM's numbers imply), each decided once the router applied every batch."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text(f"{seed}-system", 400)}]
    rows = []
    for turn in range(4):
        msgs.append({"role": "user", "content": text(f"{seed}-turn-{turn}", 60)})
        settle([router], live)
        hit0 = engines.value(dec.metrics(), SOURCES, source="local_cache_hit")
        got = ask(router.url(), model, True, msgs, False, max_tokens=16)
        reused = int(engines.value(dec.metrics(), SOURCES, source="local_cache_hit") - hit0)
        implied = "disaggregated" if (got.prompt_tokens or 0) - reused >= 512 else "direct"
        # what the router decided: a fallback (no_prefiller) was decided disaggregated
        taken = "disaggregated" if got.route in ("disaggregated", "fallback") else "direct"
        assert got.cached.endswith("; source=events"), got
        rows.append((turn + 1, got.prompt_tokens, got.cached_tokens, reused, taken, implied))
        msgs.append({"role": "assistant", "content": got.text})
    print(f"\n{seed} (turn, prompt, estimate, reused, route, vLLM says):", *rows, sep="\n")
    return rows


def test_kv_events_hybrid_estimate_is_what_every_group_holds(
    hybrid: dict[str, engines.Engine], routers: Routers, hybrid_router: Proc, model_name: str
) -> None:
    """vLLM reuses a hybrid prefix only where it checkpointed the linear-attention state
    (``mamba_cache_mode`` align): how much of a chat's next turn it reuses depends on where its
    chunks ended, which the approximate index cannot know (it claims nothing of a hybrid cache).
    The engines' KV-cache events say it: each group's blocks (``group_idx``, the spec kind; a
    Mamba group's one hash names the boundary its state was taken at), the hit being what every
    group holds (pd_router.kv_events).

    Served on the decoder (a router whose prefiller is down: ``no_prefiller``, decided on the
    events all the same), the estimate equals what vLLM reused on every turn. Over NIXL it
    cannot: the state a decoder receives is cached without a Mamba-group event (vLLM 0.31.0's
    CPU build, 2026-12-02: a decoder reused 768 and then 1,024 tokens of a chat's turns with no
    state of its own announced), so there the estimate falls short, never above."""
    dec = hybrid["decode"]
    assert cache_info(dec)["mamba_cache_mode"] == "align"
    alone = routers.start([f"http://127.0.0.1:{engines.free_port()}"], [dec.url], kind="hybrid", admitted=False)
    try:
        until("the decoder heard", lambda: metric(alone, STATE, pool="decode", state="exact") == 1)
        served = chat_turns(alone, dec, [dec], model_name, "hybrid-on-the-decoder")
    finally:
        alone.stop()
    assert all(e == r for _, _, e, r, _, _ in served), served
    assert any(r > 0 for _, _, _, r, _, _ in served), served
    assert all(t == i for *_, t, i in served), served
    until("both engines heard", lambda: metric(hybrid_router, STATE, state="exact") == 2)
    nixl = chat_turns(hybrid_router, dec, list(hybrid.values()), model_name, "hybrid-over-nixl")
    # never more than vLLM reused: the decoder would prefill what the router took for cached
    assert all(e <= r for _, _, e, r, _, _ in nixl), nixl
