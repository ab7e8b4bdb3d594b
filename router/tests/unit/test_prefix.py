"""The decode-first decision (routing.decision prefix) and its prefix index, without I/O:
every reason, the index's bounds, and the choice of decoder."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from pd_router import cache_info
from pd_router.cache_info import CacheInfo
from pd_router.config import PrefillBusy, PrefixCache, Routing
from pd_router.decide import Decider, Decision, Pools
from pd_router.discovery import Endpoint
from pd_router.failures import TokenizeError
from pd_router.prefix import TEXT_BLOCK_BYTES, PrefixIndex, identity

BLOCK_BYTES = TEXT_BLOCK_BYTES


GPU_BLOCKS = CacheInfo(block_size=16, match_unit=16, prefix_caching=True, capacity_tokens=None)


def eps(*ports: int, cache: CacheInfo | None = GPU_BLOCKS) -> list[Endpoint]:
    """Decoders that said (vllm:cache_config_info) they cache in 16-token blocks."""
    out = [Endpoint(f"http://127.0.0.1:{p}") for p in ports]
    for ep in out:
        ep.cache = cache
    return out


class NoTokenizer:
    local = None


def decider(threshold: int = 100, **routing: Any) -> Decider:
    return Decider(Routing(threshold=threshold, **routing), NoTokenizer())  # type: ignore[arg-type]


def decide(d: Decider, body: dict[str, Any], pools: Pools, chat: bool = False) -> Decision:
    async def no_engine(b: dict[str, Any], c: bool) -> list[int]:
        raise TokenizeError("no engine")  # counted as bytes / 4, as when no engine answers

    return asyncio.run(d.decide(body, chat, no_engine, pools))


def send(d: Decider, body: dict[str, Any], pools: Pools) -> Decision:
    """Decide, then record the prompt on the chosen decoder, as the app does."""
    out = decide(d, body, pools)
    if out.blocks is not None and out.decoder is not None:
        d.remember(out.decoder, out.blocks, pools.decoders)
    return out


def test_index_matches_the_leading_full_blocks_only() -> None:
    idx = PrefixIndex(capacity_tokens=1 << 20)
    (ep,) = eps(1)
    a = b"a" * (BLOCK_BYTES * 4 + 10)  # 4 full blocks and a partial one (never hashed)
    idx.record(ep, idx.of_text(a, len(a) // 4))
    assert idx.size(ep)[0] == 4
    same_head = a[: BLOCK_BYTES * 2] + b"b" * BLOCK_BYTES * 3
    assert idx.matched(ep, idx.of_text(same_head, 100)) == 2
    # a block equal to a held one but after a different head is not a hit (chained hashes)
    assert idx.matched(ep, idx.of_text(b"b" * BLOCK_BYTES + a, 100)) == 0
    ids = list(range(40))
    idx.record(ep, idx.of_ids(ids))
    assert idx.matched(ep, idx.of_ids([*ids[:32], 7, 7])) == 2
    assert idx.of_ids(ids).tokens(2) == 32


def test_index_is_bounded_and_evicts_a_prefix_tail_first() -> None:
    idx = PrefixIndex(capacity_tokens=16 * 10)  # 10 blocks per decoder
    (ep,) = eps(1)
    first = b"".join(bytes([65 + i]) * BLOCK_BYTES for i in range(6))
    idx.record(ep, idx.of_text(first, 96))
    for i in range(50):  # many other prompts of 2 blocks each
        other = bytes([i]) * BLOCK_BYTES * 2
        idx.record(ep, idx.of_text(other, 32))
        assert idx.size(ep)[0] <= 10 and idx.size(ep)[1] <= 160
        held = idx.matched(ep, idx.of_text(first, 96))
        if i == 1:  # 6 + 2 + 2 = 10: all still held
            assert held == 6
        if i == 2:  # 2 evicted: the prompt's last two blocks, its head stays matchable
            assert held == 4
    assert idx.size(ep) == (10, 160) and idx.matched(ep, idx.of_text(first, 96)) == 0


def test_forgets_decoders_that_left_the_pool() -> None:
    idx = PrefixIndex(capacity_tokens=1024)
    a, b, c = eps(1, 2, 3)
    blocks = idx.of_text(b"x" * BLOCK_BYTES, 16)
    for ep in (a, b, c):
        idx.record(ep, blocks)
    idx.forget_except([a, b])
    assert (idx.size(a)[0], idx.size(b)[0], idx.size(c)[0]) == (1, 1, 0)


LONG = "w" * (BLOCK_BYTES * 25)  # 1600 tokens at bytes / 4


def test_second_turn_of_a_conversation_is_served_where_its_prefix_is() -> None:
    d = decider(threshold=1000)
    decoders = eps(11, 12, 13)
    pools = Pools(decoders, eps(21))
    first = send(d, {"prompt": LONG}, pools)
    assert (first.disaggregate, first.reason, first.matched) == (True, "above_threshold", 0)
    # the next turn: the whole first prompt and a short new part
    nxt = send(d, {"prompt": LONG + "more words " * 20}, pools)
    assert nxt.decoder is first.decoder and nxt.reason == "prefix_cached"
    # whole 16-token blocks of the prompt's text (the template's allowance is not claimed)
    assert not nxt.disaggregate and 1580 <= nxt.matched <= 1600 and nxt.matched % 16 == 0
    # a long new part still goes through the prefiller, to the same decoder
    longer = send(d, {"prompt": LONG + "z" * 4480}, pools)  # 1120 new tokens
    assert longer.reason == "above_threshold" and longer.decoder is first.decoder
    assert 1580 <= longer.matched <= 1600


def test_short_prompts_are_below_threshold_and_still_go_to_their_prefix() -> None:
    d = decider(threshold=100_000)
    decoders = eps(11, 12, 13, 14)
    pools = Pools(decoders, eps(21))
    first = send(d, {"prompt": LONG}, pools)
    again = send(d, {"prompt": LONG + "?"}, pools)
    assert first.reason == again.reason == "below_threshold" and not again.disaggregate
    assert again.decoder is first.decoder and again.matched > 0


def test_a_hot_prefix_does_not_pin_all_load_on_one_decoder() -> None:
    d = decider(threshold=1000, prefix_cache=PrefixCache(max_load_imbalance=2))
    a, b = eps(11, 12)
    pools = Pools([a, b], eps(21))
    first = send(d, {"prompt": LONG}, pools)
    holder = first.decoder
    assert holder is not None
    holder.active = 3  # 3 more than the other: over the imbalance of 2
    moved = decide(d, {"prompt": LONG + "!"}, pools)
    assert moved.decoder is not holder and moved.matched == 0
    assert moved.reason == "above_threshold"
    holder.active = 2  # within it: the prefix wins
    assert decide(d, {"prompt": LONG + "!"}, pools).decoder is holder


def test_session_affinity_keeps_the_sessions_decoder() -> None:
    d = decider(threshold=1000)
    decoders = eps(11, 12, 13)
    other = send(d, {"prompt": LONG}, Pools(decoders, eps(21)))
    pinned = decide(d, {"prompt": LONG}, Pools(decoders, eps(21), affinity="session-7"))
    again = decide(d, {"prompt": LONG}, Pools(decoders, eps(21), affinity="session-7"))
    assert pinned.decoder is again.decoder
    # held only if the session's decoder is where the prompt went before
    assert (pinned.matched > 0) == (pinned.decoder is other.decoder)


@pytest.mark.parametrize(("busy", "reason"), [(70_000, "prefill_busy"), (10, "above_threshold")])
def test_a_busy_prefill_pool_is_bypassed_when_the_decoder_has_room(busy: int, reason: str) -> None:
    d = decider(threshold=1000, prefill_busy=PrefillBusy(queued_tokens=65536))
    pre = eps(21, 22)
    for p in pre:
        p.queued_tokens = busy
    out = decide(d, {"prompt": LONG}, Pools(eps(11), pre))
    assert out.reason == reason and out.disaggregate is (reason == "above_threshold")


def test_a_busy_prefill_pool_is_not_bypassed_onto_a_busy_decoder() -> None:
    d = decider(threshold=1000, prefill_busy=PrefillBusy(queued_tokens=100, max_decoder_requests=4))
    (pre,) = eps(21)
    pre.queued_tokens = 5000
    (dec,) = eps(11)
    dec.active = 4
    assert decide(d, {"prompt": LONG}, Pools([dec], [pre])).reason == "above_threshold"
    # one prefiller with room left: the pool is not saturated
    idle = eps(22)[0]
    dec.active = 0
    assert decide(d, {"prompt": LONG}, Pools([dec], [pre, idle])).reason == "above_threshold"
    assert decide(d, {"prompt": LONG}, Pools([dec], [pre])).reason == "prefill_busy"


def test_queued_tokens_zero_never_bypasses() -> None:
    d = decider(threshold=1000, prefill_busy=PrefillBusy(queued_tokens=0))
    (pre,) = eps(21)
    pre.queued_tokens = 10**9
    assert decide(d, {"prompt": LONG}, Pools(eps(11), [pre])).reason == "above_threshold"


def test_threshold_zero_and_batches_keep_their_reasons_in_prefix_mode() -> None:
    pools = Pools(eps(11), eps(21))
    assert decide(decider(threshold=0), {"prompt": LONG}, pools).reason == "always"
    assert decide(decider(), {"prompt": "x", "n": 2}, pools).reason == "batch"


def test_length_mode_is_the_length_rule_alone() -> None:
    d = decider(threshold=1000, decision="length")
    pools = Pools(eps(11), eps(21))
    for _ in range(2):
        out = decide(d, {"prompt": LONG}, pools)
        assert (out.reason, out.decoder, out.blocks) == ("above_threshold", None, None)
    assert decide(d, {"prompt": "hi"}, pools).reason == "below_threshold"


def test_token_id_prompts_are_indexed_by_their_ids() -> None:
    d = decider(threshold=100)
    pools = Pools(eps(11, 12), eps(21))
    ids = list(range(500))
    first = send(d, {"prompt": ids}, pools)
    nxt = decide(d, {"prompt": [*ids, 1, 2, 3]}, pools)
    # 31 full blocks of 16 held; vLLM recomputes at least the last token
    assert nxt.decoder is first.decoder and nxt.matched == 496
    assert nxt.reason == "prefix_cached"


# ---------------------------------------------------------------------- what the engine holds
# vllm:cache_config_info as vLLM 0.31.0's CPU build exports it for a dense model (trimmed to
# the labels the router reads and a few others, in vLLM's order)
VLLM_LINE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'enable_prefix_caching="True",engine="0",kv_cache_size_tokens="524288",'
    'mamba_cache_mode="none",prefix_match_unit="None",sliding_window="None"} 1.0'
)


def test_the_engines_cache_shape_is_read_from_vllms_own_metric() -> None:
    page = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        + VLLM_LINE
        + "\n"
    )
    assert cache_info.parse(page) == CacheInfo(128, 128, True, 524288)
    finer = VLLM_LINE.replace('prefix_match_unit="None"', 'prefix_match_unit="32"')
    assert cache_info.parse(finer) == CacheInfo(128, 32, True, 524288)
    off = VLLM_LINE.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert cache_info.parse(off) == CacheInfo(128, 128, False, 524288)
    hybrid = VLLM_LINE.replace('mamba_cache_mode="none"', 'mamba_cache_mode="align"')
    assert cache_info.parse(hybrid) == CacheInfo(128, 128, True, 524288, hybrid=True)
    assert cache_info.parse('vllm:num_requests_waiting{engine="0"} 0.0\n') is None
    assert cache_info.parse(VLLM_LINE.replace('block_size="128"', 'block_size="None"')) is None


def test_a_claim_is_whole_blocks_of_the_decoders_own_and_nothing_when_it_did_not_say() -> None:
    idx = PrefixIndex(capacity_tokens=1 << 20)
    cpu, silent, uncached = (
        eps(1, cache=CacheInfo(128, 128, True, None))[0],
        eps(2, cache=None)[0],
        eps(3, cache=CacheInfo(16, 16, False, None))[0],
    )
    blocks = idx.of_text(b"a" * BLOCK_BYTES * 10, 10 * 64)  # 10 text blocks of 64 tokens each
    for ep in (cpu, silent, uncached):
        idx.record(ep, blocks)
        assert idx.matched(ep, blocks) == 10
    assert idx.claimed(cpu, blocks, 10) == 640  # 5 whole 128-token blocks
    assert idx.claimed(cpu, blocks, 3) == 128  # 192 tokens: one whole block
    assert idx.claimed(silent, blocks, 10) == 0
    assert idx.claimed(uncached, blocks, 10) == 0
    # a hybrid model's prefix is reusable only where vLLM checkpointed its linear-attention
    # state, which the router cannot know (pd_router.cache_info)
    (hybrid,) = eps(4, cache=CacheInfo(256, 256, True, None, hybrid=True))
    idx.record(hybrid, blocks)
    assert idx.matched(hybrid, blocks) == 10 and idx.claimed(hybrid, blocks, 10) == 0


def test_a_decoder_that_became_healthy_again_starts_with_an_empty_picture() -> None:
    idx = PrefixIndex(capacity_tokens=1 << 20)
    (ep,) = eps(1)
    blocks = idx.of_text(b"a" * BLOCK_BYTES * 4, 256)
    idx.record(ep, blocks)
    assert idx.matched(ep, blocks) == 4
    ep.generation += 1  # discovery: unhealthy, then healthy (it may have restarted)
    assert idx.matched(ep, blocks) == 0 and idx.size(ep) == (0, 0)
    idx.record(ep, blocks)
    assert idx.matched(ep, blocks) == 4


def test_the_decoders_own_capacity_bounds_its_picture() -> None:
    idx = PrefixIndex(capacity_tokens=1 << 20)
    (ep,) = eps(1, cache=CacheInfo(16, 16, True, 16 * 5))
    idx.record(ep, idx.of_ids(list(range(16 * 20))))
    assert idx.size(ep) == (5, 80)


def chat(*messages: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


def shared_blocks(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Leading blocks of ``b`` a decoder sent ``a`` holds."""
    idx = PrefixIndex(capacity_tokens=1 << 20)
    (ep,) = eps(1)
    sa, da = identity(a, True)
    sb, db = identity(b, True)
    idx.record(ep, idx.of_text(da, len(da) // 4, sa))
    return idx.matched(ep, idx.of_text(db, len(db) // 4, sb))


SYSTEM = "You are an agent. " * 100
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
OTHER_TOOL = {
    "type": "function",
    "function": {"name": "read_file", "parameters": {"type": "object"}},
}


def test_agents_with_other_tools_share_no_block() -> None:
    """Templates render the tools before the messages: another tool set, another prompt."""
    a = chat(("system", SYSTEM), ("user", "task one"), tools=[TOOL])
    same_tools = chat(("system", SYSTEM), ("user", "task two"), tools=[TOOL])
    other_tools = chat(("system", SYSTEM), ("user", "task one"), tools=[OTHER_TOOL])
    no_tools = chat(("system", SYSTEM), ("user", "task one"))
    assert shared_blocks(a, same_tools) >= len(SYSTEM) // BLOCK_BYTES
    assert shared_blocks(a, other_tools) == shared_blocks(a, no_tools) == 0
    # the same tools with their keys in another order are the same tools (JSON objects)
    reordered = {
        "function": {"parameters": {"type": "object"}, "name": "search"},
        "type": "function",
    }
    assert shared_blocks(a, chat(("system", SYSTEM), ("user", "task one"), tools=[reordered])) > 0


def test_the_salt_roles_and_images_are_part_of_the_prompt() -> None:
    a = chat(("system", SYSTEM), ("user", "hi"))
    assert shared_blocks(a, chat(("system", SYSTEM), ("user", "hi"), cache_salt="tenant-2")) == 0
    assert shared_blocks(a, chat(("user", SYSTEM), ("user", "hi"))) == 0  # another role
    img = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with_image = {
        "messages": [{"role": "user", "content": [img, {"type": "text", "text": SYSTEM}]}]
    }
    other_image = copy.deepcopy(with_image)
    other_image["messages"][0]["content"][0]["image_url"]["url"] = "https://example.com/b.png"
    assert shared_blocks(with_image, with_image) > 0
    assert shared_blocks(with_image, other_image) == 0


def test_a_conversations_next_turn_shares_its_earlier_turns() -> None:
    turn1 = chat(("system", SYSTEM), ("user", "first question " * 30))
    turn2 = chat(
        ("system", SYSTEM),
        ("user", "first question " * 30),
        ("assistant", "an answer"),
        ("user", "next"),
    )
    held = shared_blocks(turn1, turn2)
    _, d1 = identity(turn1, True)
    assert held == len(d1) // BLOCK_BYTES  # every full block of the first turn
