"""The decode-first decision (routing.decision prefix) and its prefix index, without I/O:
every reason, the index's bounds, and the choice of decoder."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pd_router.config import PrefillBusy, PrefixCache, Routing
from pd_router.decide import Decider, Decision, Pools
from pd_router.discovery import Endpoint
from pd_router.failures import TokenizeError
from pd_router.prefix import TEXT_BLOCK_BYTES, PrefixIndex

BLOCK_BYTES = TEXT_BLOCK_BYTES


def eps(*ports: int) -> list[Endpoint]:
    return [Endpoint(f"http://127.0.0.1:{p}") for p in ports]


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
    idx = PrefixIndex(capacity_tokens=1 << 20, block_tokens=16)
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
    idx = PrefixIndex(capacity_tokens=16 * 10, block_tokens=16)  # 10 blocks per decoder
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
    idx = PrefixIndex(capacity_tokens=1024, block_tokens=16)
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
    assert not nxt.disaggregate and 1590 <= nxt.matched <= 1610
    # a long new part still goes through the prefiller, to the same decoder
    longer = send(d, {"prompt": LONG + "z" * 4480}, pools)  # 1120 new tokens
    assert longer.reason == "above_threshold" and longer.decoder is first.decoder
    assert 1590 <= longer.matched <= 1610


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
