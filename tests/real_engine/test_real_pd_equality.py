"""The main job, on the real engine: a long prompt through the router's NIXL route is prefilled on
the prefiller, its KV pulled by the decoder over NIXL (UCX), and the answer equals, token for
token, the one the same decoder gives when it serves the request alone. The decoder's own
metrics prove the KV arrived by transfer and its prefill was not redone."""

from __future__ import annotations

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.prompts import LONG_WORDS, SHORT_WORDS, ask, colocated, text

CASES = [(chat, stream) for chat in (True, False) for stream in (False, True)]
IDS = [f"{'chat' if c else 'completions'}-{'stream' if s else 'whole'}" for c, s in CASES]


@pytest.mark.parametrize(("chat", "stream"), CASES, ids=IDS)
def test_nixl_route_answers_equal_colocated_token_for_token(
    chat: bool, stream: bool, router: Proc, pd: dict[str, engines.Engine], model_name: str
) -> None:
    dec = pd["decode"]
    prompt = text(f"equal-{chat}-{stream}", LONG_WORDS)
    base = colocated(dec.url, model_name, chat, prompt)
    before = engines.by_source(dec)
    got = ask(router.url(), model_name, chat, prompt, stream)
    after = engines.by_source(dec)
    assert (got.route, got.reason) == ("disaggregated", "above_threshold")
    assert got.text == base.text and got.finish == base.finish == "length"
    assert got.prompt_tokens == base.prompt_tokens
    # the decoder computed none of the prompt: every token came over NIXL from the prefiller
    moved = after["external_kv_transfer"] - before["external_kv_transfer"]
    computed = after["local_compute"] - before["local_compute"]
    assert moved == base.prompt_tokens and computed == 0, (moved, computed)


@pytest.mark.parametrize(("chat", "stream"), CASES, ids=IDS)
def test_short_prompts_go_direct_and_equal_colocated(
    chat: bool, stream: bool, router: Proc, pd: dict[str, engines.Engine], model_name: str
) -> None:
    prompt = text(f"short-{chat}-{stream}", SHORT_WORDS)
    base = colocated(pd["decode"].url, model_name, chat, prompt)
    got = ask(router.url(), model_name, chat, prompt, stream)
    assert (got.route, got.reason) == ("direct", "below_threshold")
    assert got.text == base.text and got.prompt_tokens == base.prompt_tokens


def test_many_long_prompts_of_different_lengths_all_equal(
    router: Proc, pd: dict[str, engines.Engine], model_name: str
) -> None:
    """Lengths that end inside a KV block and on its edge (128-token blocks on the CPU build)."""
    dec, n, moved = pd["decode"], 0, 0.0
    for i, words in enumerate((300, 333, 512, 640, 1000, 1500)):
        prompt = text(f"lengths-{i}", words)
        base = colocated(dec.url, model_name, True, prompt)
        before = engines.by_source(dec)["external_kv_transfer"]
        got = ask(router.url(), model_name, True, prompt, bool(i % 2))
        moved += engines.by_source(dec)["external_kv_transfer"] - before
        assert got.route == "disaggregated" and got.text == base.text, (words, got, base)
        n += base.prompt_tokens or 0
    assert moved == n
