"""LoRA adapters on the real engine (issue 35): vLLM 0.31.0's CPU build serving adapters made
offline (harness/tiny_lora.py) as the chart renders them (model.lora.adapters; the dev
environment, rendered.LORA_SETS), the router told of them by the chart's router.yaml.

The prefiller is rendered with the first adapter only and the decoder with both: two engines of
a rollout that adds the second adapter, the prefiller not replaced yet. So:

- the first adapter's long prompts are handed off, and each answer equals the same request
  served whole by the decoder, token for token (chat and completions, streamed and not), while
  the base model answers the same prompt otherwise (the negative control: an adapter that
  changed nothing would pass the equality for free);
- the second adapter's long prompts never reach the prefiller (which cannot serve it: its KV
  would be the base model's, and vLLM's decoder would take it, measured in docs/lora.md): each
  is served whole by the decoder as ``no_adapter_pair``, equal to its answer there;
- the router's KV-event estimate for an adapter's prompt equals what vLLM reused, and is 0 for
  the same prompt under the base model or the other adapter (vLLM hashes an adapter's blocks
  with its name: v1/core/kv_cache_utils.py ``_gen_lora_extra_hash_keys``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pd_router_dev.devstack import Proc

from tests.engines.rendered import LORA_ADAPTERS, lora_sets
from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.events import settle
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers

BOTH, DECODER_ONLY = LORA_ADAPTERS
HIT = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def lora_pd(pairs: Pairs) -> Iterator[dict[str, engines.Engine]]:
    yield pairs.get("dense", "env:dev lora one", decode_render="env:dev lora")


@pytest.fixture(scope="module")
def lora_router(lora_pd: dict[str, engines.Engine], routers: Routers) -> Proc:
    # the router of the release that serves both adapters (the chart renders it with the values)
    return routers.start([lora_pd["prefill"].url], [lora_pd["decode"].url], sets=lora_sets(LORA_ADAPTERS))


@pytest.mark.parametrize(("chat", "stream"), [(True, False), (True, True), (False, False), (False, True)])
def test_lora_an_adapters_hand_off_equals_it_served_whole(
    lora_pd: dict[str, engines.Engine], lora_router: Proc, model_name: str, chat: bool, stream: bool
) -> None:
    prompt = text(f"lora-both-{chat}-{stream}", LONG_WORDS)
    got = ask(lora_router.url(), BOTH, chat, prompt, stream)
    assert (got.route, got.reason) == ("disaggregated", "above_threshold"), got
    whole = colocated(lora_pd["decode"].url, BOTH, chat, prompt)
    assert got.text == whole.text, (got.text, whole.text)
    base = colocated(lora_pd["decode"].url, model_name, chat, prompt)
    assert base.text != whole.text  # the adapter changes the answer: the equality means something
    print(f"\nlora hand-off chat={chat} stream={stream}: {got.prompt_tokens} prompt tokens, equal, base differs")


def test_lora_a_prefiller_lacking_the_adapter_is_never_paired_for_it(
    lora_pd: dict[str, engines.Engine], lora_router: Proc
) -> None:
    pre = lora_pd["prefill"]
    before = engines.value(pre.metrics(), "vllm:request_success_total")
    for stream in (False, True):
        prompt = text(f"lora-decoder-only-{stream}", LONG_WORDS)
        got = ask(lora_router.url(), DECODER_ONLY, True, prompt, stream)
        assert (got.route, got.reason) == ("fallback", "no_adapter_pair"), got
        assert got.text == colocated(lora_pd["decode"].url, DECODER_ONLY, True, prompt).text
    assert engines.value(pre.metrics(), "vllm:request_success_total") == before  # never asked


def test_lora_kv_events_estimate_equals_vllms_reuse_and_nothing_across_adapters(
    lora_pd: dict[str, engines.Engine], lora_router: Proc, model_name: str
) -> None:
    dec = lora_pd["decode"]
    live = list(lora_pd.values())
    prompt = text("lora-events", LONG_WORDS)
    first = ask(lora_router.url(), BOTH, True, prompt, False, max_tokens=4)
    assert first.route == "disaggregated", first  # the decoder now holds it, under the adapter
    rows = []
    for model in (BOTH, model_name, DECODER_ONLY):
        settle([lora_router], live)  # the router has applied every event the engines published
        hit0 = engines.value(dec.metrics(), HIT, source="local_cache_hit")
        got = ask(lora_router.url(), model, True, prompt, False, max_tokens=4)
        hit1 = engines.value(dec.metrics(), HIT, source="local_cache_hit")
        rows.append((model, got.cached_tokens, got.cached_source, int(hit1 - hit0), got.route))
    print(f"\nlora kv events (model, estimate, source, vLLM reused, route): {rows}")
    (_, est, source, reused, _), *others = rows
    assert source == "events" and est == reused > 0, rows
    assert [(m, e, r) for m, e, _, r, _ in others] == [(m, 0, 0) for m, *_ in others], rows
