"""The chart's default model is hybrid (Qwen3.5: Gated DeltaNet linear attention beside full
attention). A tiny Qwen3.5-style model stands for it on vLLM's CPU build (bfloat16, the only dtype
its GDN kernel takes; a tie-free output head, tests/engines/harness/tiny_model.py): the NIXL
hand-off moves its attention KV and its Mamba-style state, exactly: the decoder's answer from a
hand-off equals, token and logprob, its own answer from its own cache; a longer answer parts
from the colocated one (the whole prompt computed at once) only where two tokens are one
bfloat16 step apart. The router claims only whole blocks of the size vLLM chose for it (vLLM
aligns a hybrid model's attention block with its Mamba state; cache_config_info says which),
and its KV-cache events say what each KV-cache group holds.

Measured (this 2-core machine, 2026-12-07, vLLM 0.31.0's CPU build, ``pytest -s
tests/real_engine/test_real_hybrid.py``): a prompt of 2,049 token ids (block 256) handed off
gave 24 of 24 tokens and every logprob equal to the decoder's own from its cache (largest
difference 0.0); of 13 prompts of 1,200-1,644 ids, 9 answers of 24 tokens equal the colocated
ones and 4 part at a swap of two tokens one step (0.25) apart, at steps 0 to 4 (the model's
logits lie on bfloat16's 2**-2 grid, so such ties are common); a hand-off of another prompt's
KV is a defect by the same rule in 4 of 4. One token changed in the middle of a 1,200-id prompt
changed no answer: the tiny model's answers depend on a prompt as a whole, so a hand-off that
lost a block here and there might pass; one that moved the wrong KV cannot."""

from __future__ import annotations

import json
import random
import uuid
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
    decoder's own, through the router, chat and completions, streamed and not. Longer answers
    are the tests below: the hand-off is exactly the decoder's own computation from its cache,
    and where an answer parts from the colocated one it is a bfloat16 tie."""
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


# ---------------------------------------------------------------- the hand-off's exactness
LOGPROBS = 5
CHUNK = 2048  # the CPU build's max_num_batched_tokens: a longer prompt is prefilled in chunks
# bfloat16 keeps 8 significant bits: the tiny hybrid model's logits, between 32 and 64 in
# magnitude, lie on a grid of 2**-2, and so do the gaps between its logprobs (checked below).
# Two tokens one step of that grid apart may swap when the same sums are added in another order.
BF16_STEP = 2**-2
EXACT = 1e-6  # logprobs of one computation, read twice


def _ids(seed: str, n: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(16, vocab - 16) for _ in range(n)]


def _complete(url: str, model: str, ids: list[int], salt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": salt,
        **extra,
    }
    status, got, _ = engines.post(url, "/v1/completions", body, timeout=300)
    assert status == 200, got
    return got


def _handed_off(
    pre: engines.Engine,
    dec: engines.Engine,
    model: str,
    ids: list[int],
    max_tokens: int,
    top: int,
    prefill: list[int] | None = None,
) -> dict[str, Any]:
    """The prompt prefilled on ``pre`` and decoded on ``dec`` from the KV and state it pulls
    (the router's NIXL route, bypassed), one fresh salt for both legs; ``prefill``: another
    prompt of the same length prefilled instead (a negative control)."""
    salt = uuid.uuid4().hex
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    pre_answer = _complete(pre.url, model, prefill or ids, salt, 1, kv_transfer_params=kv)
    return _complete(
        dec.url, model, ids, salt, max_tokens, logprobs=top, kv_transfer_params=pre_answer["kv_transfer_params"]
    )["choices"][0]


def _moved(e: engines.Engine, before: str, source: str) -> float:
    return engines.value(e.metrics(), SOURCES, source=source) - engines.value(before, SOURCES, source=source)


def _steps(choice: dict[str, Any]) -> list[tuple[str, float, dict[str, float]]]:
    lp = choice["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))


def test_hybrid_handoff_is_exactly_the_decoders_own_computation_from_its_cache(
    hybrid: dict[str, engines.Engine], model_name: str
) -> None:
    """What a hand-off makes the decoder do, done on the decoder alone: a prompt of k·B + 1
    token ids (B the block vLLM aligned to the model's state), its cache warmed with the first
    k·B (same salt), so that it computes the last token only, from its own cached KV and state;
    against the same prompt handed off with a fresh salt, where it computes the last token from
    what it pulled. Equal tokens and logprobs (within EXACT) on every step: the transfer is
    exact, and a difference from the colocated answer (the whole prompt computed at once, the
    chunked-prefill kernels) is the kernels' rounding, not the hand-off's."""
    pre, dec = hybrid["prefill"], hybrid["decode"]
    block = int(cache_info(dec)["block_size"])
    assert CHUNK % block == 0, block
    vocab = json.loads((engines.model("hybrid") / "config.json").read_text())["vocab_size"]
    k = CHUNK // block
    ids = _ids("hybrid-exact", k * block + 1, vocab)
    salt = uuid.uuid4().hex
    # the decoder's cache: the first k·B, and the state there, which vLLM keeps where a chunk
    # ended (align mode): a longer prompt whose first chunk ends at k·B
    _complete(dec.url, model_name, ids[:-1] + _ids("hybrid-exact-rest", block, vocab), salt, 1)
    before = dec.metrics()
    warm = _complete(dec.url, model_name, ids, salt, 24, logprobs=LOGPROBS)["choices"][0]
    assert _moved(dec, before, "local_cache_hit") == k * block  # it computed the last token only
    before = dec.metrics()
    handed = _handed_off(pre, dec, model_name, ids, 24, LOGPROBS)
    assert _moved(dec, before, "external_kv_transfer") == k * block  # all but the last came over
    cold = _complete(dec.url, model_name, ids, uuid.uuid4().hex, 24, logprobs=LOGPROBS)["choices"][0]
    assert handed["text"] == warm["text"]
    worst = 0.0
    for (t1, lp1, top1), (t2, lp2, top2) in zip(_steps(warm), _steps(handed), strict=True):
        assert t1 == t2 and top1.keys() == top2.keys()
        worst = max(worst, abs(lp1 - lp2), *(abs(top1[t] - top2[t]) for t in top1))
    assert worst <= EXACT, worst
    noise = []  # the colocated logprobs against these, up to where the answers part
    for a, b in zip(_steps(warm), _steps(cold), strict=True):
        if a[0] != b[0]:
            break
        noise.append(abs(a[1] - b[1]))
    print(
        f"\nhybrid hand-off, block {block}, prompt {len(ids)} ids: equal to the warm decoder's own on 24 of 24 "
        f"steps (largest logprob difference {worst:.1e}); the colocated answer "
        f"{'equal' if cold['text'] == warm['text'] else 'different'}, logprobs off by up to {max(noise, default=0.0):.1e} where "
        "the tokens agree"
    )


def _parting(cold: list, handed: list) -> tuple[Any, ...]:
    """("equal",), or where the answers part: ("swap", step, colocated gap, handed-off gap) if
    the handed-off token was the colocated second choice and each run ranked the two at most
    one bfloat16 step apart, else ("defect", step)."""
    at = next((j for j, (a, b) in enumerate(zip(cold, handed, strict=True)) if a[0] != b[0]), None)
    if at is None:
        return ("equal",)
    token, best, top = cold[at]
    got, got_lp, got_top = handed[at]
    if got not in top or token not in got_top:
        return ("defect", at)
    gap, theirs = best - top[got], got_lp - got_top[token]
    if gap <= BF16_STEP and theirs <= BF16_STEP:
        return ("swap", at, gap, theirs)
    return ("defect", at)


def test_hybrid_longer_answers_part_from_colocated_only_at_bfloat16_ties(
    hybrid: dict[str, engines.Engine], model_name: str
) -> None:
    """Longer greedy answers (prompts of one chunk, prefilled at once), handed off against
    colocated: equal, or, at the first token where they part, a swap of two tokens one
    bfloat16 step apart (BF16_STEP): the colocated run ranked the handed-off token second, at
    most one step below its first, and the handed-off run ranked them at most one step apart
    the other way. That every logprob gap lies on the grid is checked (the step is the
    model's own). Negative control: a hand-off of another prompt's KV (another prompt of the
    same length) decoded as this prompt's, which the rule must call a defect (in 3 of 4 at
    least; 4 of 4 on 2026-12-07)."""
    pre, dec = hybrid["prefill"], hybrid["decode"]
    vocab = json.loads((engines.model("hybrid") / "config.json").read_text())["vocab_size"]
    verdicts, wrong = [], []
    for i in range(13):
        ids = _ids(f"hybrid-tie-{i}", 1200 + 37 * i, vocab)
        cold = _steps(_complete(dec.url, model_name, ids, uuid.uuid4().hex, 24, logprobs=2)["choices"][0])
        gaps = [best - lp for _, best, top in cold for lp in top.values()]
        assert all(abs(g / BF16_STEP - round(g / BF16_STEP)) < 1e-3 for g in gaps), gaps
        verdicts.append((i, *_parting(cold, _steps(_handed_off(pre, dec, model_name, ids, 24, 2)))))
        if i < 4:
            other = _ids(f"hybrid-other-{i}", len(ids), vocab)
            wrong.append(_parting(cold, _steps(_handed_off(pre, dec, model_name, ids, 24, 2, prefill=other)))[0])
    assert [v for v in verdicts if v[1] == "defect"] == [], verdicts
    assert wrong.count("defect") >= 3, wrong
    swaps = [v for v in verdicts if v[1] == "swap"]
    print(
        f"\nhybrid, 13 prompts of 1,200-1,644 ids, 24 tokens: {len(verdicts) - len(swaps)} equal to colocated; "
        f"one-step swaps (prompt, step, colocated gap, handed-off gap): {[(v[0], *v[2:]) for v in swaps]}; "
        f"another prompt's KV: {wrong}"
    )
