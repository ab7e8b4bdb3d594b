"""The precise prefix index from vLLM's KV-cache events (pd_router.kv_events): what a stream of
events makes of one engine's picture, the hit vLLM's coordinators would find, the publisher
check, the ZMQ subscriber's sequence handling over real sockets on loopback, its memory per
block, and the decision reading it.

The wire is encoded here with the router's own mirror of vLLM's classes; the real-engine tier
(tests/real_engine/test_real_kv_events.py) proves it against vLLM's own publisher."""

from __future__ import annotations

import asyncio
import gc
import threading
import tracemalloc
from typing import Any

import msgspec
import pytest
import zmq

from pd_router.config import KvEvents, Routing
from pd_router.decide import Decider, Pools
from pd_router.discovery import Endpoint
from pd_router.kv_events import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    EngineBlocks,
    Identity,
    KvEventIndex,
    identity_of,
    source_of,
)

BS = 4
_enc = msgspec.msgpack.Encoder()


def stored(ids, hashes, parent=None, bs=BS, extra=None, group=None, kind=None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(ids),
        block_size=bs,
        extra_keys=extra,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


plain = Identity().extras  # a request without salt or LoRA


IDS = list(range(100, 120))  # 5 blocks of 4


def test_stored_blocks_chain_and_a_hit_stops_at_the_first_missing_block() -> None:
    e = EngineBlocks(1)
    e.apply([stored(IDS[:8], [11, 12])])  # blocks 0, 1
    e.apply([stored(IDS[8:12], [13], parent=12)])  # block 2, chained through its parent
    assert e.blocks == 3
    assert e.hit_tokens(IDS, plain) == 12
    # all but the last prompt token, in whole blocks (get_computed_blocks): 12 tokens hit 8
    assert e.hit_tokens(IDS[:12], plain) == 8
    # another prompt sharing the first block only
    assert e.hit_tokens([*IDS[:4], 1, 2, 3, 4, 5, 6, 7, 8, 9], plain) == 4
    e.apply([BlockRemoved(block_hashes=[12])])
    assert e.hit_tokens(IDS, plain) == 4  # block 2 is unreachable past the evicted block 1
    e.apply([AllBlocksCleared()])
    assert e.blocks == 0 and e.hit_tokens(IDS, plain) == 0


def test_a_block_whose_parent_was_never_announced_is_not_indexed() -> None:
    e = EngineBlocks(1)
    e.apply([stored(IDS[4:8], [12], parent=11)])
    assert e.blocks == 0  # under-claims: what came before the router subscribed is unknown


def test_cache_salt_is_the_first_blocks_extra_key_and_changes_every_block() -> None:
    e = EngineBlocks(1)
    e.apply([stored(IDS[:12], [21, 22, 23], extra=[("s1",), None, None])])
    salted = Identity(salt="s1").extras
    assert e.hit_tokens(IDS, salted) == 12
    assert e.hit_tokens(IDS, plain) == 0  # the same tokens without the salt
    assert e.hit_tokens(IDS, Identity(salt="s2").extras) == 0


def test_a_lora_name_is_every_blocks_extra_key() -> None:
    e = EngineBlocks(1)
    e.apply([stored(IDS[:8], [31, 32], extra=[("ad",), ("ad",)])])
    assert e.hit_tokens(IDS[:9], Identity(lora="ad").extras) == 8
    assert e.hit_tokens(IDS[:9], plain) == 0


def test_requests_the_router_cannot_reproduce_are_marked() -> None:
    img = {"type": "image_url", "image_url": {"url": "data:,x"}}
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, img]}]}
    assert not identity_of(chat, True, None).reproducible
    assert not identity_of({"prompt_embeds": "..."}, False, None).reproducible
    ok = identity_of(
        {"messages": [{"role": "user", "content": "a"}], "cache_salt": "x"}, True, None
    )
    assert ok.reproducible and ok.salt == "x"


def test_hybrid_hit_is_what_every_group_holds() -> None:
    """vLLM 0.31.0 HybridKVCacheCoordinator.find_longest_cache_hit: each group shortens the
    candidate length until all agree; full attention holds a leading run, Mamba one state at
    the hit's last block."""
    e = EngineBlocks(1)
    e.kinds = {0: "full_attention", 1: "mamba"}
    e.apply([stored(IDS[:16], [1, 2, 3, 4], group=0)])  # attention: blocks 0..3
    e.apply([stored(IDS[:4], [1], group=1), stored(IDS[4:8], [2], parent=1, group=1)])
    # Mamba's state is held at blocks 0 and 1 (as vLLM's align mode checkpoints)
    e.apply([BlockRemoved(block_hashes=[1], group_idx=1)])  # ... then only at block 1
    assert e.hit_tokens(IDS, plain) == 8  # attention would give 16; Mamba's last state is at 8
    e.apply([BlockRemoved(block_hashes=[2], group_idx=1)])
    assert e.hit_tokens(IDS, plain) == 0  # no state anywhere: nothing is reusable


def test_sliding_window_needs_its_window_of_blocks_before_the_hit() -> None:
    e = EngineBlocks(1)
    e.kinds = {0: "full_attention", 1: "sliding_window"}
    e.apply([stored(IDS[:16], [1, 2, 3, 4], group=0)])
    e.apply([stored(IDS[:16], [1, 2, 3, 4], group=1, kind="sliding_window")])
    e.groups[1].window = 8  # 8 tokens: the last 2 blocks before the hit
    e.apply([BlockRemoved(block_hashes=[1, 3], group_idx=1)])  # holds blocks 1 and 3 only
    assert e.hit_tokens(IDS, plain) == 0  # no two consecutive blocks end anywhere
    e.apply([stored(IDS[8:12], [3], parent=2, group=1)])
    assert e.hit_tokens(IDS, plain) == 16  # blocks 2, 3 held before length 16


def test_source_of_checks_the_publisher_against_the_config() -> None:
    cfg = KvEvents()
    good = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv",
        }
    }
    src, why = source_of(good, "10.0.0.7", cfg)
    assert src is not None and not why
    assert src.endpoint == "tcp://10.0.0.7:5557" and src.replay == "tcp://10.0.0.7:5558"
    assert src.topic == b"kv"
    assert source_of(good, "fd00::7", cfg)[0].endpoint == "tcp://[fd00::7]:5557"
    assert source_of({}, "h", cfg) == (None, "publishes no KV events")
    for change, words in (
        ({"endpoint": "tcp://*:6000"}, "routing.kvEvents.port 5557"),
        ({"endpoint": "tcp://router:5557"}, "bind endpoint"),  # the engine connects out
        ({"topic": ""}, "routing.kvEvents.topic"),
        ({"publisher": "null"}, "no KV events"),
    ):
        bad = {"0": {**good["0"], **change}}
        src, why = source_of(bad, "h", cfg)
        assert src is None and words in why, (change, why)
    two = {"0": good["0"], "1": good["0"]}
    assert "2 data-parallel" in source_of(two, "h", cfg)[1]
    no_replay = {"0": {**good["0"], "replay_endpoint": None}}
    assert source_of(no_replay, "h", cfg)[0].replay is None
    # port 0: whatever each engine says (engines sharing one host, as in the real-engine tier)
    anyport = {"0": {**good["0"], "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001"}}
    src, _ = source_of(anyport, "h", KvEvents(port=0, replay_port=0))
    assert (src.endpoint, src.replay) == ("tcp://h:6000", "tcp://h:6001")


def test_memory_per_block(capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes per indexed block, and the total at a million blocks (printed for the notes)."""
    n = 1_000_000
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    e = EngineBlocks(1)
    bs = 16
    ids = list(range(bs))
    step = 1000
    for j in range(n // step):  # a thousand 1000-block prompts, 64-bit hashes as vLLM's
        hashes = [(j * step + i) * 2654435761 % (1 << 64) for i in range(step)]
        ev = stored([], hashes, bs=bs)
        ev.token_ids = [j] + ids[1:] + ids * (step - 1)
        e.apply([ev])
        ev.token_ids = []  # what is kept is the index, not the event
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert e.blocks == n
    per = used / n
    with capsys.disabled():
        print(f"\nkv events index: {per:.0f} bytes per block, {used / 2**20:.0f} MiB at {n:,}")
    assert per < 400


# ---------------------------------------------------------------- over real ZMQ sockets
class Publisher:
    """vLLM's ZmqEventPublisher wire (0.31.0): PUB frames (topic, seq, batch), and a replay
    ROUTER answering [id, b"", start] with the buffered batches and seq -1."""

    def __init__(self, ctx: zmq.Context[Any], replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.router = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and self.router is not None:
            if not self.router.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, buf in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart((ident, b"", b"kv", seq.to_bytes(8, "big"), buf))
            self.router.send_multipart((ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def publish(self, *events: Any, send: bool = True, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        payload = _enc.encode(Batch(0.0, list(events)))
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class Index:
    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.cond = threading.Condition()
        self.kv = KvEventIndex(KvEvents())

    def counted(self, outcome: str) -> None:
        with self.cond:
            self.outcomes.append(outcome)
            self.cond.notify_all()

    def wait(self, pred, timeout: float = 10) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, timeout), self.outcomes


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def subscribe(ix: Index, pub: Publisher, capacity: int = 0) -> None:
    from pd_router.kv_events import Source

    replay = f"tcp://127.0.0.1:{pub.replay_port}" if pub.replay_port else None
    ix.kv.watch("decode", "e1", 1, Source(f"tcp://127.0.0.1:{pub.port}", replay, b"kv"), capacity)


def joined(ix: Index, pub: Publisher) -> None:
    """PUB/SUB joins asynchronously: publish probes (empty batches) until one is heard."""
    n = len(ix.outcomes)
    while True:
        pub.publish()
        with ix.cond:
            if ix.cond.wait_for(lambda: len(ix.outcomes) > n, 0.05):
                return


def test_subscriber_applies_repairs_a_gap_by_replay_and_restarts_on_a_new_sequence(zctx) -> None:
    pub = Publisher(zctx)
    ix = Index()
    ix.kv.start(ix.counted)
    try:
        subscribe(ix, pub)
        joined(ix, pub)
        pub.publish(stored(IDS[:8], [1, 2]))
        ix.wait(lambda: ix.kv.engines["e1"].blocks == 2)
        assert ix.kv.exact("e1", 1) is not None and ix.kv.exact("e1", 2) is None
        # a batch lost on the way (as at PUB's high-water mark): the next one shows the gap
        pub.publish(stored(IDS[8:12], [3], parent=2), send=False)
        pub.publish(stored(IDS[12:16], [4], parent=3))
        ix.wait(lambda: ix.kv.engines["e1"].blocks == 4)
        assert "replayed" in ix.outcomes and "gap" not in ix.outcomes
        assert ix.kv.exact("e1", 1).hit_tokens(IDS, plain) == 16
        # the engine restarted: its sequence starts again at 0
        pub.publish(stored(IDS[:4], [1]), seq=0)
        ix.wait(lambda: "restarted" in ix.outcomes)
        ix.wait(lambda: ix.kv.engines["e1"].blocks == 1)
    finally:
        ix.kv.stop()
        pub.close()


def test_a_gap_without_replay_leaves_the_engine_uncertain_until_its_cache_turned_over(
    zctx,
) -> None:
    pub = Publisher(zctx, replay=False)
    ix = Index()
    ix.kv.start(ix.counted)
    try:
        subscribe(ix, pub, capacity=3)
        joined(ix, pub)
        pub.publish(stored(IDS[:8], [1, 2]))
        ix.wait(lambda: ix.kv.engines["e1"].blocks == 2)
        pub.publish(BlockRemoved(block_hashes=[2]), send=False)  # missed: an eviction unseen
        pub.publish(stored([7] * 4, [9]))
        ix.wait(lambda: "gap" in ix.outcomes)
        assert ix.kv.exact("e1", 1) is None and ix.kv.state("e1", 1) == "uncertain"
        pub.publish(stored([8] * 8, [10, 11]))  # 3 blocks stored since the gap: whole again
        ix.wait(lambda: ix.kv.state("e1", 1) == "exact")
        assert ix.kv.exact("e1", 1).hit_tokens(IDS, plain) == 0  # block 2 is not claimed
    finally:
        ix.kv.stop()
        pub.close()


# ---------------------------------------------------------------- the decision reads it
def test_decision_uses_the_events_exact_hit_and_picks_the_prefiller_holding_the_prefix() -> None:
    kv = KvEventIndex(KvEvents())
    d1, d2, p1, p2 = (Endpoint(f"http://10.0.0.{i}:8000") for i in range(1, 5))
    for ep in (d1, d2, p1, p2):
        ep.generation = 1
    prompt = list(range(1000, 1040))  # 40 token ids: 10 blocks
    held = EngineBlocks(1)
    held.apply([stored(prompt[:32], list(range(1, 9)))])  # 8 blocks: 32 tokens
    kv.engines[d2.base] = held
    pre = EngineBlocks(1)
    pre.apply([stored(prompt[:8], [1, 2])])
    kv.engines[p2.base] = pre
    kv.engines[d1.base] = EngineBlocks(1)  # exact and empty
    dec = Decider(Routing(threshold=20), counter=_NoCounter(), events=kv)
    pools = Pools([d1, d2], [p1, p2])

    async def no_tokenize(body, chat):
        raise AssertionError("token-id prompts are not tokenized")

    d = asyncio.run(dec.decide({"prompt": prompt}, False, no_tokenize, pools))
    assert (d.decoder, d.matched, d.estimate) == (d2, 32, "events")
    assert d.reason == "prefix_cached" and not d.disaggregate  # 8 uncached < 20
    longer = prompt + list(range(2000, 2040))
    d = asyncio.run(dec.decide({"prompt": longer}, False, no_tokenize, pools))
    assert d.disaggregate and d.matched == 32 and d.prefiller is p2


class _NoCounter:
    local = None


def test_a_state_groups_block_names_the_boundary_it_was_checkpointed_at() -> None:
    """vLLM 0.31.0's CPU build, a Qwen3.5-style hybrid: the attention group announces one hash
    per block, each Mamba group one hash for the state at the end of the tokens it lists (768
    tokens, one hash); the next state chains from it."""
    ids = list(range(500, 540))  # 10 blocks of 4
    e = EngineBlocks(1)
    e.hybrid = True
    e.apply([stored(ids[:12], [1, 2, 3], group=3, kind="full_attention")])
    assert e.hit_tokens(ids, plain) == 0  # no state group has spoken: nothing is known reusable
    e.apply([stored(ids[:12], [30], group=0, kind="mamba", extra=[("s",)])])
    assert e.hit_tokens(ids, plain) == 0  # that state was salted
    assert e.hit_tokens(ids, Identity(salt="s").extras) == 0  # and attention holds no salted KV
    e.apply([stored(ids[:12], [3], group=0), stored(ids[:12], [3], group=1, kind="mamba")])
    assert e.hit_tokens(ids, plain) == 12  # the state at 12 tokens, attention up to 12
    e.apply([stored(ids[12:16], [4], parent=3, group=g) for g in (3, 1)])
    assert e.hit_tokens(ids, plain) == 12  # every group must hold it: group 0 does not yet
    e.apply([stored(ids[12:16], [4], parent=3, group=0)])
    assert e.hit_tokens(ids, plain) == 16
    e.apply([stored(ids[16:20], [5], parent=4, group=3)])
    assert e.hit_tokens(ids, plain) == 16  # attention holds 20, the last state is at 16


def test_a_picture_that_outgrows_the_engines_cache_is_dropped() -> None:
    """Removals that never came (a publisher dropping them) would grow the index past what the
    engine can hold: at OVERFULL times its cache the picture is dropped and uncertain."""
    e = EngineBlocks(1)
    e.capacity_blocks = 4
    e.apply([stored(list(range(32)), list(range(1, 9)))])  # 8 blocks: 2x the cache, kept
    assert e.blocks == 8 and e.certain
    e.apply([stored(list(range(100, 104)), [50])])
    assert e.blocks == 0 and not e.certain
