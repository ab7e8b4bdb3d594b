"""vLLM's KV-cache event publisher, as the simulator's prefix cache needs it
(``--kv-events-config``, checked against vLLM 0.31.0 ``distributed/kv_events.py``
``ZmqEventPublisher`` and ``v1/core/block_pool.py``, and against its CPU build on the wire:
tests/real_engine).

A ZMQ PUB bound on the config's ``endpoint`` sends (topic, 8-byte big-endian sequence number,
msgpack ``EventBatch`` ``[ts, events, data_parallel_rank]``), one batch per event-loop turn in
which the cache changed (vLLM: one per engine step); a ROUTER on ``replay_endpoint`` answers
``[id, b"", start]`` with every buffered batch from ``start`` and then seq -1. ``BlockStored``
carries the newly cached full blocks of one sequence (hashes, the parent's hash, their token
ids, the block size), ``BlockRemoved`` one evicted block; blocks reused from the cache are not
announced again. ``GET /kv_event_sources`` reports the config by data-parallel rank (``{}``
when off). Not modelled: ``extra_keys`` (the simulator has no cache_salt, LoRA or multimodal
input), several KV-cache groups, ``AllBlocksCleared`` (it has no reset_prefix_cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

_U64 = (1 << 64) - 1  # vLLM folds its hashes to 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # KVEventsConfig.buffer_steps (0.31.0)


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = 0


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = 0


def parse_config(raw: str) -> dict[str, Any]:
    """``--kv-events-config`` JSON, as vLLM's KVEventsConfig resolves it (ValueError: why not)."""
    cfg = json.loads(raw)
    if not isinstance(cfg, dict):
        raise ValueError("--kv-events-config: expected a JSON object")
    out = {
        "enable_kv_cache_events": bool(cfg.get("enable_kv_cache_events", False)),
        "publisher": cfg.get("publisher")
        or ("zmq" if cfg.get("enable_kv_cache_events") else "null"),
        "endpoint": cfg.get("endpoint", "tcp://*:5557"),
        "replay_endpoint": cfg.get("replay_endpoint"),
        "buffer_steps": BUFFER_STEPS,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": cfg.get("topic", ""),
    }
    if out["publisher"] not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown publisher {out['publisher']!r}")
    return out


def config_json(port: int, replay_port: int, topic: str = "kv") -> str:
    """``--kv-events-config`` for an engine publishing on ``port`` with its replay ROUTER on
    ``replay_port`` (the chart's shape: templates/engine/_args.tpl), for engines sharing a host."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": topic,
        }
    )


def _hash(h: int) -> int:
    return h & _U64


class Publisher:
    def __init__(self, cfg: dict[str, Any], block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(cfg["endpoint"])
        self.replay: zmq.asyncio.Socket | None = None
        if cfg.get("replay_endpoint"):
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(cfg["replay_endpoint"])
        self.topic = cfg["topic"].encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self.pending: list[BlockStored | BlockRemoved] = []
        self.encode = msgspec.msgpack.Encoder().encode
        self.task: asyncio.Task[None] | None = None

    def sources(self) -> dict[str, Any]:
        return {"0": self.cfg}

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int]) -> None:
        self._queue(
            BlockStored(
                [_hash(h) for h in hashes],
                None if parent is None else _hash(parent),
                list(tokens),
                self.block_size,
                None,
                "GPU",
                None,
                [None] * len(hashes),
            )
        )

    def removed(self, h: int) -> None:
        self._queue(BlockRemoved([_hash(h)], "GPU"))

    def _queue(self, ev: BlockStored | BlockRemoved) -> None:
        if not self.pending:
            with contextlib.suppress(RuntimeError):  # no loop: flushed by the next change
                asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(ev)

    def flush(self) -> None:
        if not self.pending:
            return
        payload = self.encode(EventBatch(time.time(), self.pending))
        self.pending = []
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # PUB drops past its high-water mark, as vLLM's
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def start(self) -> None:
        if self.replay is not None and self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        sock = self.replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and answers nothing
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, buf in list(self.buffer):
                if seq >= first:
                    await sock.send_multipart((ident, b"", self.topic, seq.to_bytes(8, "big"), buf))
            await sock.send_multipart((ident, b"", b"", _END_SEQ, b""))

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()


def published(replay_endpoint: str, timeout_s: float = 10.0) -> int:
    """How many batches a publisher (vLLM's or this one) has sent, asked of its replay ROUTER
    (``[b"", start]`` -> every buffered batch, then seq -1): what tests wait for a router to
    have applied before they decide on what the engines hold."""
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    try:
        d.connect(replay_endpoint)
        d.send_multipart((b"", (0).to_bytes(8, "big")))
        last = -1
        while True:
            if not d.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"{replay_endpoint} did not answer a replay request")
            frames = d.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return last + 1
            last = seq
    finally:
        d.close()
