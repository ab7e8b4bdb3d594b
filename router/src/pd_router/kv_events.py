"""What every engine's KV cache holds, from vLLM's own KV-cache events: the precise prefix index.

Each engine publishes (``--kv-events-config``, rendered by the chart for both roles) every block
it stores and evicts over ZMQ PUB; the router subscribes to every engine that says so on
``GET /kv_event_sources`` and keeps, per engine, the blocks it holds. pd_router.decide asks
:meth:`KvEventIndex.held` instead of the approximate index (pd_router.prefix) wherever an
engine's picture is exact. Checked against vLLM 0.31.0 (its CPU build too) and 0.33.0:
``distributed/kv_events.py`` (wire), ``v1/core/block_pool.py`` (what is published),
``v1/core/kv_cache_coordinator.py`` (how a hit is found).

Wire: multipart (topic, 8-byte big-endian sequence number, msgpack ``EventBatch``
``[ts, events, data_parallel_rank]``); events are maps tagged ``type``: ``BlockStored``
(block_hashes, parent_block_hash, token_ids, block_size, lora_name, extra_keys one entry per
block: LoRA name, ``(mm_identifier, offset)`` pairs, cache_salt, prompt-embeds digests, untagged;
group_idx), ``BlockRemoved`` (block_hashes, group_idx), ``AllBlocksCleared``. The replay ROUTER
answers ``[b"", start_seq]`` with every buffered batch from ``start_seq`` as
``[b"", topic, seq, payload]`` and ends with seq -1.

Decision: index the token ids the events carry, not vLLM's block hashes. Recomputing vLLM's
hashes needs its hash function (``--prefix-caching-hash-algo``), its NONE_HASH seed (random per
process unless PYTHONHASHSEED is set) and the 64-bit folding of
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, all of which change across versions; the token ids are
the ground truth they are a hash of. So each stored block gets a router key, ``hash((parent's
key, its token ids, its extra keys))``, chained through the engine's parent hash, and a
request's blocks get the same keys from its token ids as vLLM renders them (the engine's
/tokenize, same body). The hash algorithm then cannot disagree between chart, router and
engines; what can is the block size (each event carries it, and the request is cut at each
group's own size) and the publisher's endpoint and topic (checked against ``/kv_event_sources``
when the engine is admitted).

A request whose identity the router cannot reproduce claims nothing: images or other non-text
parts (multimodal hashes), prompt embeddings. cache_salt is the first block's extra key, a LoRA
name every block's (``generate_block_hash_extra_keys``), so both are reproduced.

Each time the subscription's connection comes up, the router asks the replay endpoint for what
it may have missed: everything from sequence 0 the first time (vLLM keeps
``buffer_steps`` batches): a router replica started next to running engines knows their caches
at once. An engine's picture starts empty when it (re)starts: a new healthy generation, a
sequence number that goes back (a new publisher), ``AllBlocksCleared``. A gap in the sequence is
repaired from the replay endpoint; when the replay cannot reach back that far (or there is
none), the picture is dropped and marked *uncertain*
(``pd_router_kv_events_engines{state="uncertain"}``): the approximate index stands in for that
engine until it has stored as many blocks as its cache holds since (every block it then holds
was announced after the gap). Dropping only ever under-claims; keeping a picture across a gap
could over-claim blocks evicted unseen.

Threads: one daemon thread per process owns the ZMQ sockets, decodes and applies the events; the
event loop only reads (``key in dict``, safe under the GIL). Each router replica and worker
process subscribes on its own (PUB fans out); none needs the others.

Memory: two dict entries and two ints per block (the engine's hash -> key, key -> count):
router/tests/test_kv_events.py measures it per block and at a million blocks.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pd_router.config import KvEvents

log = logging.getLogger("pd_router.kv_events")

ROOT = 0  # the router key a first block chains from (vLLM's NONE_HASH)
# A picture of more blocks than this many times the engine's cache (per KV-cache group) has
# missed removals: it is dropped (uncertain), which bounds the index's memory per engine.
OVERFULL = 2
REPLAY_TIMEOUT_SECONDS = 2.0  # a replay not finished by then leaves the engine uncertain
# After a SUB's handshake its subscription still travels to the PUB, which drops what it sends
# meanwhile: the replay of what the connection missed is asked this long after the handshake
# (what is published after the request arrives live; the two are merged by sequence number).
JOIN_REPLAY_DELAY_SECONDS = 0.25
# The thread sleeps this long after a wake-up before it reads: the engines' batches of one burst
# are applied together, at most this much later (make bench: the router's CPU per request).
COALESCE_SECONDS = 0.005
_END_SEQ = -1
_POLL_MS = 100
# kv_cache_spec kinds (v1/kv_cache_interface.py KVCacheSpecKind) whose hit is the last block(s)
# before the hit length, not a leading run: Mamba keeps one state, a sliding window its window
_LAST_BLOCK_KINDS = ("mamba",)
_WINDOW_KINDS = ("sliding_window", "sliding_window_mla", "chunked_local_attention")
_ATTENTION_KINDS = ("full_attention", "mla_attention", "sink_full_attention")

Hash = int | bytes


# ---------------------------------------------------------------- wire (vLLM's msgspec classes)
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[Hash] = []
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[Hash] = []
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode_batch = msgspec.msgpack.Decoder(Batch).decode


# ---------------------------------------------------------------- where an engine publishes
@dataclass(frozen=True, slots=True)
class Source:
    endpoint: str  # what the router's SUB connects to
    replay: str | None  # the replay ROUTER, or None
    topic: bytes


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _port_of(endpoint: Any) -> int | None:
    """The port of a *bind* endpoint (``tcp://*:5557``): one the router can connect to."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or "*" not in endpoint:
        return None
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def source_of(sources: Any, host: str, cfg: KvEvents) -> tuple[Source | None, str]:
    """The engine's publisher from its ``/kv_event_sources`` answer (``{rank: KVEventsConfig}``,
    vLLM 0.31.0 ``entrypoints/serve/instrumentator/basic.py``), or None and why not."""
    if not isinstance(sources, dict) or not sources:
        return None, "publishes no KV events"
    if len(sources) != 1:
        return None, f"has {len(sources)} data-parallel publishers (one index per engine only)"
    c = next(iter(sources.values()))
    if (
        not isinstance(c, dict)
        or not c.get("enable_kv_cache_events")
        or c.get("publisher") != "zmq"
    ):
        return None, "publishes no KV events over ZMQ"
    port = _port_of(c.get("endpoint"))
    if port is None or (cfg.port and port != cfg.port):
        return None, (
            f"publishes on {c.get('endpoint')!r}, not on routing.kvEvents.port {cfg.port} "
            "(a bind endpoint tcp://*:PORT)"
        )
    if c.get("topic", "") != cfg.topic:
        return None, f"publishes topic {c.get('topic')!r}, not routing.kvEvents.topic {cfg.topic!r}"
    replay = None
    rport = _port_of(c.get("replay_endpoint"))
    if rport is not None and (not cfg.replay_port or rport == cfg.replay_port):
        replay = _tcp(host, rport)  # else a gap cannot be repaired: it waits to rebuild
    return Source(_tcp(host, port), replay, cfg.topic.encode()), ""


# ---------------------------------------------------------------- one engine's blocks
def _frozen(x: Any) -> Any:
    """An extra key as a hashable value (msgpack gives lists for tuples)."""
    if isinstance(x, list | tuple):
        return tuple(_frozen(v) for v in x)
    return x


def chain(ids: Sequence[int], block_size: int, extras: Sequence[Any] = ()) -> list[int]:
    """Router keys of a prompt's full blocks: ``extras[i]`` is block i's extra-key tuple (None
    or absent: none), as vLLM's events publish them."""
    out: list[int] = []
    k = ROOT
    n = len(extras)
    for i in range(len(ids) // block_size):
        ex = extras[i] if i < n else None
        k = hash((k, tuple(ids[i * block_size : (i + 1) * block_size]), ex))
        out.append(k)
    return out


class Group:
    """One KV-cache group's blocks on one engine (a hybrid model has several)."""

    __slots__ = ("block_size", "by_hash", "held", "kind", "window")

    def __init__(self) -> None:
        self.by_hash: dict[Hash, int] = {}  # engine block hash -> router key
        self.held: dict[int, int] = {}  # router key -> blocks holding it
        self.block_size = 0
        self.kind = "full_attention"
        self.window = 0


class EngineBlocks:
    """What one engine (one healthy generation of it) holds, built from its events."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.groups: dict[int, Group] = {}
        self.blocks = 0
        self.certain = True
        self.stored_since_gap = 0
        self.capacity_blocks = 0  # the engine's cache in blocks (0: unknown)
        self.last_seq: int | None = None
        self.kinds: dict[int, str] = {}  # group -> spec kind, when the engine said
        # a Mamba/linear-attention model (cache_info: mamba_cache_mode): its hit also needs its
        # state groups, which may not have announced anything yet
        self.hybrid = False

    def clear(self) -> None:
        self.groups = {}
        self.blocks = 0

    def uncertain(self) -> None:
        self.clear()
        self.certain = False
        self.stored_since_gap = 0

    def apply(self, events: Sequence[Any]) -> None:
        for ev in events:
            if type(ev) is BlockStored:
                self._stored(ev)
            elif type(ev) is BlockRemoved:
                self._removed(ev)
            else:
                self.clear()  # AllBlocksCleared: reset_prefix_cache or a restart

    def _group(self, idx: int | None) -> Group:
        g = self.groups.get(idx or 0)
        if g is None:
            g = self.groups[idx or 0] = Group()
            kind = self.kinds.get(idx or 0)
            if kind:
                g.kind = kind
        return g

    def _stored(self, ev: BlockStored) -> None:
        g = self._group(ev.group_idx)
        if ev.kv_cache_spec_kind:
            g.kind = ev.kv_cache_spec_kind
            g.window = ev.kv_cache_spec_sliding_window or 0
        parent = ev.parent_block_hash
        k: int | None = ROOT
        if parent is not None:  # vLLM's hashes name a prefix boundary, whatever the group
            k = g.by_hash.get(parent)
            if k is None:
                k = next(
                    (o.by_hash[parent] for o in self.groups.values() if parent in o.by_hash), None
                )
        if k is None:
            return  # its parent was never announced (before the router subscribed): unknown
        bs = ev.block_size
        hashes = ev.block_hashes
        if bs <= 0 or not hashes:
            return
        g.block_size = g.block_size or bs
        toks, extras = ev.token_ids, ev.extra_keys or ()
        # The hashes name the last len(hashes) block boundaries the tokens span: one each for
        # attention; a Mamba group's state names only the boundary it was checkpointed at, its
        # tokens running from the parent's (vLLM 0.31.0 CPU build: one hash, 768 tokens).
        skip = len(toks) // bs - len(hashes)
        if skip < 0:
            return
        spans = [None] * skip + list(hashes)
        n_extra = len(extras)
        for i, h in enumerate(spans):
            # a span's extra keys go with its first chunk (cache_salt: the prompt's first)
            j = 0 if i == 0 else (i - skip if i > skip else n_extra)
            ex = _frozen(extras[j]) if j < n_extra else None
            k = hash((k, tuple(toks[i * bs : (i + 1) * bs]), ex))
            if h is None:
                continue
            if h in g.by_hash:
                continue
            g.by_hash[h] = k
            g.held[k] = g.held.get(k, 0) + 1
            self.blocks += 1
            self.stored_since_gap += 1
        cap = self.capacity_blocks
        if cap and self.blocks > OVERFULL * cap * len(self.groups):
            # more than its cache can hold: removals went missing; the bound on memory
            log.warning("kv events: an engine's picture outgrew its cache; dropped")
            self.uncertain()
            return
        if not self.certain and cap and self.stored_since_gap >= cap:
            self.certain = True  # every block it holds now was announced after the gap
            log.info("kv events: an engine's picture is whole again after a gap")

    def _removed(self, ev: BlockRemoved) -> None:
        g = self.groups.get(ev.group_idx or 0)
        if g is None:
            return
        for h in ev.block_hashes:
            k = g.by_hash.pop(h, None)
            if k is None:
                continue
            self.blocks -= 1
            n = g.held.get(k, 0) - 1
            if n > 0:
                g.held[k] = n
            else:
                g.held.pop(k, None)

    def hit_tokens(self, ids: Sequence[int], extras: Callable[[int], list[Any]]) -> int:
        """Prompt tokens vLLM would find cached (``find_longest_cache_hit`` of the unitary and
        hybrid coordinators: each group shortens the candidate length until all agree; at most
        all but the last prompt token, ``kv_cache_manager.get_computed_blocks``).
        ``extras(n)``: the request's extra keys for n blocks."""
        groups = [g for g in self.groups.values() if g.block_size > 0]
        if not groups:
            return 0
        if self.hybrid and all(g.kind in _ATTENTION_KINDS for g in groups):
            return 0  # its state groups announced nothing yet: they hold nothing known
        length = max(0, len(ids) - 1)
        cache: dict[int, list[int]] = {}
        while True:
            start = length
            for g in groups:
                bs = g.block_size
                keys = cache.get(bs)
                if keys is None:
                    n = len(ids) // bs
                    keys = cache[bs] = chain(ids, bs, extras(n))
                length = _group_hit(g, keys, length)
            if length == start:
                return length


def _group_hit(g: Group, keys: list[int], length: int) -> int:
    bs = g.block_size
    n = min(length // bs, len(keys))
    held = g.held
    if g.kind in _LAST_BLOCK_KINDS or g.kind in _WINDOW_KINDS:
        need = 1 if g.kind in _LAST_BLOCK_KINDS else max(1, -(-max(0, g.window - 1) // bs))
        for i in range(n, 0, -1):  # the last ``need`` blocks before i held
            if all(keys[j] in held for j in range(max(0, i - need), i)):
                return i * bs
        return 0
    i = 0
    while i < n and keys[i] in held:
        i += 1
    return i * bs


# ---------------------------------------------------------------- the index and its thread
@dataclass(frozen=True, slots=True)
class Identity:
    """What a request adds to its blocks' identity besides the token ids."""

    salt: str | None = None
    lora: str | None = None
    reproducible: bool = True  # False: multimodal parts or embeddings (claims nothing)

    def extras(self, n: int) -> list[Any]:
        out: list[Any] = []
        for i in range(n):
            keys: tuple[Any, ...] = ()
            if self.lora is not None:
                keys += (self.lora,)
            if i == 0 and self.salt is not None:
                keys += (self.salt,)
            out.append(keys or None)
        return out


def identity_of(body: dict[str, Any], chat: bool, lora: str | None) -> Identity:
    salt = body.get("cache_salt")
    ok = isinstance(salt, str | None) and "prompt_embeds" not in body
    if chat and ok:
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list) and any(
                not (isinstance(p, dict) and p.get("type") == "text") for p in c
            ):
                ok = False
                break
    return Identity(salt if isinstance(salt, str) else None, lora, ok)


class Publisher(Protocol):
    """An engine as :meth:`KvEventIndex.sync` reads it (pd_router.discovery.Endpoint)."""

    base: str
    generation: int
    events: Source | None  # where it publishes, when it does
    cache: Any  # pd_router.cache_info.CacheInfo | None: its blocks, for the index's capacity


class KvEventIndex:
    """Every subscribed engine's blocks; ``held`` is what the decision reads."""

    def __init__(self, cfg: KvEvents, on_state: Callable[[str, str, int], None] | None = None):
        self.cfg = cfg
        self.engines: dict[str, EngineBlocks] = {}  # endpoint base -> its blocks
        self._on_state = on_state  # (pool, state, engines) for the gauge
        self._pools: dict[str, str] = {}  # base -> pool
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._wake_addr = f"inproc://pd-kv-events-{id(self)}"
        self._wake: zmq.Socket[Any] | None = None
        self.batches = 0  # batches applied (tests wait on it through the metrics)
        self._counted: Callable[[str], None] = lambda outcome: None
        # loop side: base -> (pool, (generation, source)) subscribed to (sync)
        self._watched: dict[str, tuple[str, tuple[int, Source]]] = {}

    # ---------------------------------------------------------------- loop side
    def exact(self, base: str, generation: int) -> EngineBlocks | None:
        """The engine's picture if it is exact for this generation, else None (approximate)."""
        e = self.engines.get(base)
        return e if e is not None and e.generation == generation and e.certain else None

    def state(self, base: str, generation: int) -> str:
        e = self.engines.get(base)
        if e is None or e.generation != generation:
            return "approximate"
        return "exact" if e.certain else "uncertain"

    def start(self, counted: Callable[[str], None] | None = None) -> None:
        if counted is not None:
            self._counted = counted
        self._ctx = zmq.Context()
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.bind(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name="pd-kv-events", daemon=True)
        self._thread.start()

    def _send(self, *cmd: Any) -> None:
        self._cmds.put(cmd)
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(zmq.ZMQError):
                wake.send(b"", zmq.NOBLOCK)

    def watch(
        self,
        pool: str,
        base: str,
        generation: int,
        source: Source,
        capacity_blocks: int,
        hybrid: bool = False,
    ) -> None:
        """Subscribe to ``base``'s publisher for this generation (a new one starts empty)."""
        self._send("watch", pool, base, generation, source, capacity_blocks, hybrid)

    def unwatch(self, base: str) -> None:
        self._send("unwatch", base)

    def sync(self, pool: str, healthy: Sequence[Publisher]) -> None:
        """``pool``'s healthy engines changed: subscribe to each one that publishes, afresh
        for a new generation; drop the others (an engine back from down is another generation
        anyway)."""
        live = {ep.base: (ep.generation, ep.events) for ep in healthy if ep.events is not None}
        watched = self._watched
        for base in [b for b, (p, _) in watched.items() if p == pool and b not in live]:
            del watched[base]
            self.unwatch(base)
        for ep in healthy:
            key = live.get(ep.base)
            if key is None or watched.get(ep.base) == (pool, key):
                continue
            watched[ep.base] = (pool, key)
            cap = 0
            if ep.cache is not None and ep.cache.capacity_tokens:
                cap = ep.cache.capacity_tokens // ep.cache.block_size
            hybrid = ep.cache is not None and ep.cache.hybrid
            assert ep.events is not None
            self.watch(pool, ep.base, ep.generation, ep.events, cap, hybrid)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._send("stop")
        self._thread.join(timeout=2)
        self._thread = None
        if self._wake is not None:
            self._wake.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        assert self._ctx is not None
        _Subscriber(self, self._ctx).run()

    def _report(self) -> None:
        if self._on_state is None:
            return
        counts: dict[tuple[str, str], int] = {}
        for base, pool in self._pools.items():
            e = self.engines.get(base)
            if e is None:
                continue
            key = (pool, "exact" if e.certain else "uncertain")
            counts[key] = counts.get(key, 0) + 1
        for pool in set(self._pools.values()) | {"prefill", "decode"}:
            for state in ("exact", "uncertain"):
                self._on_state(pool, state, counts.get((pool, state), 0))


class _Subscriber:
    """The KV-event thread of one :class:`KvEventIndex`: a SUB socket per watched engine, its
    connection monitor (each handshake asks the engine's replay for what the SUB missed), the
    replays in flight and the batches held until they answer. Only this thread touches the
    sockets; the index's ``engines`` it writes are read by the event loop (whole-object
    swaps and appends, safe under the GIL)."""

    def __init__(self, index: KvEventIndex, ctx: zmq.Context[Any]) -> None:
        self.index = index
        self.ctx = ctx
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.connect(index._wake_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.wake, zmq.POLLIN)
        self.subs: dict[str, zmq.Socket[Any]] = {}  # base -> SUB
        self.monitors: dict[zmq.Socket[Any], str] = {}  # a SUB's connection events -> base
        self.due: dict[str, float] = {}  # base -> when to replay what its new connection missed
        self.by_sock: dict[zmq.Socket[Any], str] = {}  # a SUB or a replay DEALER -> base
        # base -> (its replay DEALER, the deadline, the batches that came meanwhile)
        self.replays: dict[str, tuple[zmq.Socket[Any], float, list[tuple[int, bytes]]]] = {}
        self.sources: dict[str, Source] = {}

    def run(self) -> None:
        try:
            while self._step():
                pass
        finally:
            for base in list(self.subs):
                self.close(base)
            self.wake.close(linger=0)

    def _step(self) -> bool:
        """One turn: what the sockets have, the replays now due or overdue, the commands; False
        once told to stop."""
        ready = self.poller.poll(_POLL_MS)
        if ready and COALESCE_SECONDS:
            # let a burst gather: one wake-up (and GIL hand-over) per burst, not per batch
            time.sleep(COALESCE_SECONDS)
            ready = self.poller.poll(0)
        for s, _ in ready:
            self._readable(s)
        now = time.monotonic()
        self._ask_due(now)
        self._expire_replays(now)
        return self._commands()

    def _readable(self, s: zmq.Socket[Any]) -> None:
        if s in self.monitors:
            self.joined(self.monitors[s], s)
            return
        if s is self.wake:
            with contextlib.suppress(zmq.ZMQError):
                while True:
                    self.wake.recv(zmq.NOBLOCK)
            return
        base = self.by_sock.get(s)
        if base is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # zmq.Again included: drained
            while True:
                frames = s.recv_multipart(zmq.NOBLOCK)
                if s is self.subs.get(base):
                    if len(frames) == 3:
                        self.take(base, int.from_bytes(frames[1], "big"), frames[2])
                else:
                    self.replayed(base, frames)
                if s.closed:
                    break

    def _ask_due(self, now: float) -> None:
        for base, at in list(self.due.items()):
            e = self.index.engines.get(base)
            if now < at or e is None:
                continue
            del self.due[base]
            if base not in self.replays:
                self.ask_replay(base, 0 if e.last_seq is None else e.last_seq + 1, [])

    def _expire_replays(self, now: float) -> None:
        for base, (_, deadline, held) in list(self.replays.items()):
            if now < deadline:
                continue
            e = self.index.engines.get(base)
            if e is not None and e.last_seq is None:
                # the replay on subscribing: without it only the blocks stored before are
                # unknown (under-claimed), so the picture stays exact
                self._drop_replay(base)
                log.warning("kv events: %s: its replay did not answer in time", base)
            else:
                self.give_up(base, "the replay did not answer in time")
            for sq, p in sorted(held):
                if e is not None:
                    self.apply(e, sq, p)

    def _commands(self) -> bool:
        ix = self.index
        while True:
            try:
                cmd = ix._cmds.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "stop":
                return False
            if cmd[0] == "unwatch":
                self.close(cmd[1])
                self.sources.pop(cmd[1], None)
                ix.engines.pop(cmd[1], None)
                ix._pools.pop(cmd[1], None)
                ix._report()
                continue
            self._watch(*cmd[1:])

    def _watch(
        self, pool: str, base: str, generation: int, source: Source, capacity: int, hybrid: bool
    ) -> None:
        ix = self.index
        self.close(base)
        self.sources[base] = source
        e = EngineBlocks(generation)
        e.capacity_blocks = capacity
        e.hybrid = hybrid
        ix.engines[base] = e
        ix._pools[base] = pool
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic)
        # PUB/SUB joins asynchronously: what is published before the connection is up is lost
        # to it, so each handshake asks the replay for what came meanwhile
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.monitors[mon] = base
        self.poller.register(mon, zmq.POLLIN)
        sock.connect(source.endpoint)
        self.subs[base] = sock
        self.by_sock[sock] = base
        self.poller.register(sock, zmq.POLLIN)
        log.info("kv events: subscribed to %s (%s)", source.endpoint, base)
        ix._report()

    def _drop_replay(self, base: str) -> None:
        r = self.replays.pop(base, None)
        if r is not None:
            self.poller.unregister(r[0])
            self.by_sock.pop(r[0], None)
            r[0].close(linger=0)

    def close(self, base: str) -> None:
        self.due.pop(base, None)
        s = self.subs.pop(base, None)
        if s is not None:
            for mon in [m for m, b in self.monitors.items() if b == base]:
                self.poller.unregister(mon)
                del self.monitors[mon]
                s.disable_monitor()
                mon.close(linger=0)
            self.poller.unregister(s)
            self.by_sock.pop(s, None)
            s.close(linger=0)
        self._drop_replay(base)

    def ask_replay(self, base: str, start: int, held: list[tuple[int, bytes]]) -> bool:
        src = self.sources.get(base)
        if src is None or src.replay is None:
            return False
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(src.replay)
        d.send_multipart((b"", start.to_bytes(8, "big")))
        self.poller.register(d, zmq.POLLIN)
        self.by_sock[d] = base
        self.replays[base] = (d, time.monotonic() + REPLAY_TIMEOUT_SECONDS, held)
        return True

    def joined(self, base: str, mon: zmq.Socket[Any]) -> None:
        """The SUB's connection is up (again): replay what was published before it was, from
        the start the first time (a router started next to running engines then knows their
        caches at once), else from past the last batch applied."""
        up = False
        with contextlib.suppress(zmq.Again):
            while True:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
                up = up or ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        if up:  # the subscription reaches the PUB just after the handshake: ask a bit later
            self.due[base] = time.monotonic() + JOIN_REPLAY_DELAY_SECONDS

    def give_up(self, base: str, why: str) -> None:
        e = self.index.engines.get(base)
        self._drop_replay(base)
        if e is not None:
            log.warning("kv events: %s: %s; approximate index until rebuilt", base, why)
            e.uncertain()
            self.index._counted("gap")
            self.index._report()

    def take(self, base: str, seq: int, payload: bytes) -> None:
        e = self.index.engines.get(base)
        if e is None:
            return
        last = e.last_seq
        if base in self.replays:
            self.replays[base][2].append((seq, payload))  # applied once the replay is in
            return
        if last is not None and seq <= last:
            if seq < last:  # a new publisher (the engine restarted): start empty
                e.clear()
                self.index._counted("restarted")
            else:
                return  # a duplicate
        elif (last is None and seq > 0) or (last is not None and seq > last + 1):
            start = 0 if last is None else last + 1
            if self.ask_replay(base, start, [(seq, payload)]):
                return
            if last is not None:
                self.give_up(base, f"events {start}..{seq - 1} were missed and cannot be replayed")
            # never seen: what came before only makes the picture smaller (under-claims)
        self.apply(e, seq, payload)

    def apply(self, e: EngineBlocks, seq: int, payload: bytes) -> None:
        ix = self.index
        try:
            batch = _decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kv events: an unreadable batch (seq %d): %s", seq, exc)
            ix._counted("malformed")
            e.last_seq = seq
            return
        was = e.certain
        e.apply(batch.events)
        e.last_seq = seq
        ix.batches += 1
        ix._counted("applied")
        if e.certain != was:
            ix._report()

    def replayed(self, base: str, frames: list[bytes]) -> None:
        r = self.replays.get(base)
        e = self.index.engines.get(base)
        if r is None or e is None or len(frames) != 4:
            return
        seq = int.from_bytes(frames[2], "big", signed=True)
        if seq == _END_SEQ:
            held = r[2]
            self._drop_replay(base)
            for s, p in sorted(held):
                self.take(base, s, p)
            return
        last = e.last_seq
        if last is not None and seq <= last:
            return
        if last is not None and seq > last + 1:
            self.give_up(base, f"the replay starts at {seq}, after {last + 1}")
            return
        self.apply(e, seq, frames[3])
        self.index._counted("replayed")


def lora_of(model: Any, names: Sequence[str]) -> str | None:
    """The LoRA adapter a request names (vLLM's ``lora_name`` is the served adapter name), or
    None for the base model (its served name or its revision's)."""
    return None if not isinstance(model, str) or model in names else model


def base_host(base: str) -> str:
    return urlsplit(base).hostname or ""
