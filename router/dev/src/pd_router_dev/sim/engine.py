"""The simulated engine core: sequences, vLLM V1's step scheduler and its timing model.

Scheduling as ``vllm/v1/core/sched/scheduler.py`` (0.31) ``Scheduler.schedule`` does it with
chunked prefill (on by default for generative models, ``engine/arg_utils.py``
``_set_default_chunked_prefill_and_prefix_caching_args``): each step has a token budget,
``max_num_batched_tokens``; the running requests are served first, in the order they were
admitted, each taking what it still needs (1 token to decode, or the rest of a partly
prefilled prompt) up to what is left of the budget; then waiting requests are admitted in
arrival order while budget is left and fewer than ``max_num_seqs`` run, each prefilling a
chunk of at most the remaining budget. A long prompt thus spans several steps and a
colocated decode stalls for one chunk per step, not for a whole prompt. A sequence samples
a token at the end of the step that finishes its prompt and of every decode step after.

Step time (``step_time``), all times ``slow_factor`` under the ``slow`` fault:

- ``sum`` (the default): ``prefill_ms_per_token`` x prompt tokens computed in the step + (when
  the step decodes anything) ``decode_step_ms + decode_step_ms_per_seq`` x decoding sequences;
- ``max`` (a roofline, what ``make bench``'s mixed-traffic scenario uses): the larger of the
  compute-bound time, ``prefill_ms_per_token`` x every token of the step (prompt chunks and
  decode tokens alike), and the memory-bound time, ``decode_step_ms`` (one read of the
  weights, paid by any forward pass) + ``decode_step_ms_per_seq`` x decoding sequences (their
  KV). Decode tokens batched with a prefill chunk then cost almost nothing, which is why vLLM
  schedules them together (chunked prefill after Sarathi-Serve, Agrawal et al., OSDI 2024;
  vLLM's docs/configuration/optimization.md "Chunked Prefill": compute-bound prefills and
  memory-bound decodes in one batch). ``sum`` charges a mixed step both, so it is
  pessimistic for a colocated engine, and makes a 1-token prefill step almost free, which
  is optimistic for a disaggregated decoder; ``max`` is fair to both.

Prefix caching (vLLM's automatic prefix caching, on by default: ``engine/arg_utils.py``
``_set_default_chunked_prefill_and_prefix_caching_args``; ``--prefix-cache-tokens 0`` is
``--no-enable-prefix-caching``) follows the v1 KV cache manager (``v1/core/kv_cache_manager.py``,
``block_pool.py``, ``single_type_kv_cache_manager.py`` ``FullAttentionManager``,
``kv_cache_utils.py``), see ``PrefixCache``: only full 16-token blocks are hashed, each hash
chaining its parent's; at admission a request takes the longest run of cached blocks from
the start of its prompt, never the whole prompt (at least its last token is computed), and
computes only the rest, so its prefill chunks and step time count uncached tokens only; a KV
connector's tokens (NIXL, LMCache) count past the local hit. Blocks are cached as their
tokens are scheduled (prompt and generated tokens alike), including the blocks a connector
delivered; a finished request's blocks go back to the free queue tail-first, and the pool
hands out its least recently used free block, evicting its hash.

Not modelled: preemption and KV-cache capacity limits on admission (a request never waits
for blocks: past the pool it computes without caching), ``long_prefill_token_threshold``,
speculative decoding, async scheduling, ``cache_salt`` and prompt logprobs (which skip the
prefix cache in vLLM), a NIXL prefiller holding its blocks until the decoder pulled them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_router_dev.sim import model as M

if TYPE_CHECKING:
    from pd_router_dev.sim.kv_events import Publisher
    from pd_router_dev.sim.metrics import VllmMetrics

BLOCK_SIZE = 16  # config/cache.py (0.31) CacheConfig.DEFAULT_BLOCK_SIZE
# stands in for kv_cache_utils.py NONE_HASH, the parent "hash" of a sequence's first block
NONE_HASH = 0x5F3759DF9E3779B9


def hash_block(parent: int | None, tokens: Sequence[int]) -> int:
    """kv_cache_utils.py (0.31) ``hash_block_tokens``: a full block's hash covers its parent
    block's hash (``NONE_HASH`` for the first block) and its token ids, so it names the whole
    prefix up to its end. vLLM hashes with sha256 (or xxhash); Python's tuple hash is enough
    here (not salted for ints, so stable across processes)."""
    return hash((NONE_HASH if parent is None else parent, tuple(tokens)))


def block_hashes(tokens: Sequence[int], start: Sequence[int] = ()) -> list[int]:
    """kv_cache_utils.py ``get_request_block_hasher``: the hashes of ``tokens``' full blocks
    (a partial last block has none), continuing the chain ``start`` already holds."""
    out = list(start)
    for i in range(len(out) * BLOCK_SIZE, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        out.append(hash_block(out[-1] if out else None, tokens[i : i + BLOCK_SIZE]))
    return out


def _runs(ids: list[int]) -> list[list[int]]:
    """Consecutive runs of ascending block indexes."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class PrefixCache:
    """One engine's KV block pool with automatic prefix caching, as ``v1/core/block_pool.py``
    ``BlockPool`` keeps it (checked against vLLM 0.31.0), reduced to block ids, hashes and
    reference counts.

    ``num_blocks`` blocks, block 0 the null block vLLM never hands out; the free queue holds
    every block no request uses, cached ones included (``FreeKVCacheBlockQueue``): a new
    block is taken from its head and loses its hash then (``get_new_blocks``,
    ``_maybe_evict_cached_block``); a cache hit on a free block takes it out of the queue
    (``touch``); a finished request's blocks come back in reverse order, hashed ones at the
    tail (reused last: LRU), unhashed ones at the head (``free_blocks``;
    ``single_type_kv_cache_manager.py`` ``free``: "tail blocks are evicted first"). A hash
    may name several blocks (the pool does not deduplicate: ``BlockHashToBlockMap``); a hit
    takes the first. Blocks past the pool (vLLM would hold the request back) are ``-1``:
    computed, never cached."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, dict[int, None]] = {}  # block hash -> the blocks holding it
        self.num_cached = 0  # blocks with a hash (in use or free)
        self.events: Publisher | None = None  # --kv-events-config (sim/kv_events.py)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """``FullAttentionManager.find_longest_cache_hit``: the cached blocks of the longest
        run of ``hashes`` from the first, at most ``max_blocks``; the chain makes a miss
        final."""
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            blocks = self.cached.get(h)
            if not blocks:
                break
            hit.append(next(iter(blocks)))
        return hit

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def new_block(self) -> int:
        if not self.free:
            return -1
        b = self.free.popitem(last=False)[0]
        h = self.hash_of[b]
        if h is not None:  # evicted
            holders = self.cached[h]
            del holders[b]
            if not holders:
                del self.cached[h]
            self.hash_of[b] = None
            self.num_cached -= 1
            if self.events is not None:  # block_pool.py _maybe_evict_cached_block
                self.events.removed(h)
        self.ref[b] = 1
        return b

    def cache(self, block: int, h: int) -> bool:
        """``cache_full_blocks``: a block just filled enters the cache under its hash; whether
        it did (a block past the pool, or one already cached, does not)."""
        if block < 0 or self.hash_of[block] is not None:
            return False
        self.hash_of[block] = h
        self.cached.setdefault(h, {})[block] = None
        self.num_cached += 1
        return True

    def free_blocks(self, ordered: Sequence[int]) -> None:
        """``free_blocks``: ``ordered`` first to be reused first (a request's in reverse)."""
        first: list[int] = []
        for b in ordered:
            if b < 0:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is None:
                    first.append(b)
                else:
                    self.free[b] = None  # the tail: evicted last
        for b in reversed(first):  # prepend_n: the head, in their order
            self.free[b] = None
            self.free.move_to_end(b, last=False)

    def stats(self) -> dict[str, int]:
        free = len(self.free)
        return {
            "block_size": BLOCK_SIZE,
            "num_blocks": self.num_blocks,
            "cached_blocks": self.num_cached,
            "free_blocks": free,
            "in_use_blocks": self.num_blocks - 1 - free,
        }


@dataclass(slots=True)
class Event:
    """One sampled token of one choice, as the front end turns it into output."""

    index: int
    token: int
    text: str  # text released by this token (stop-string hold-back applied)
    finish: str | None
    stop_reason: int | str | None
    state: int = 0  # the sequence's state before this token (model.top_logprobs)


class Run:
    """The sequences of one HTTP request (``n`` choices per prompt) and their events."""

    def __init__(
        self,
        metrics: VllmMetrics,
        n: int,
        cache: PrefixCache | None = None,
        connector: bool = False,
    ) -> None:
        self.metrics = metrics
        self.n = n
        self.cache = cache  # the engine's prefix cache; None: prefix caching off
        self.connector = connector  # the engine has a KV connector (NIXL, LMCache)
        self.seqs: list[Seq] = []
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.scheduled = False
        self.kv_wait = 0.0  # seconds a NIXL decoder waits for the prompt's KV
        self.direct = False  # events returned to the caller, not queued (zero-delay path)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.seqs)

    def cancel(self) -> None:
        for s in self.seqs:
            s.cancelled = True
            s.free()

    def _child_finished(self) -> None:
        # vllm/v1/engine/parallel_sampling.py observe_finished_request: the n and the
        # longest output of a parent are recorded once its last child finishes
        if all(s.done and not s.cancelled for s in self.seqs):
            by_prompt: dict[int, list[Seq]] = {}
            for s in self.seqs:
                by_prompt.setdefault(s.prompt_index, []).append(s)
            for group in by_prompt.values():
                self.metrics.max_gen.observe(max(s.n_out for s in group))
                self.metrics.params_n.observe(self.n)


class Seq:
    """One sequence (a choice of one prompt): its generator, stop rules and timestamps."""

    __slots__ = (
        "arrival",
        "blocks",
        "cancelled",
        "done",
        "external",
        "finish",
        "first_ts",
        "gen",
        "hashes",
        "index",
        "last_ts",
        "local_hit",
        "max_model_len",
        "max_tokens",
        "min_tokens",
        "n_cached_blocks",
        "n_out",
        "prefill_left",
        "prompt",
        "prompt_index",
        "prompt_len",
        "run",
        "scheduled_ts",
        "states",
        "stop_ids",
        "stop_reason",
        "text",
        "tokens",
        "uncached",
    )

    def __init__(
        self,
        run: Run,
        index: int,
        prompt_index: int,
        prompt: list[int],
        max_tokens: int,
        max_model_len: int,
        uncached: int,
        *,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        include_stop_str_in_output: bool = False,
        choice: int = 0,
        weights: int = 0,
    ) -> None:
        self.run = run
        self.index = index
        self.prompt_index = prompt_index
        self.gen = M.Generator(prompt, ignore_eos, choice, weights)
        self.text = M.TextState(stop or [], include_stop_str_in_output, min_tokens)
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.min_tokens = min_tokens
        self.stop_ids = frozenset(stop_token_ids or ())
        self.uncached = uncached
        self.prefill_left = max(uncached, 1)  # the last prompt token is always computed
        # prompt tokens a KV connector delivers (NIXL's pull, LMCache's retrieve); past the
        # local prefix-cache hit, which admission (``mark_scheduled``) finds
        self.external = max(0, len(prompt) - self.prefill_left)
        self.local_hit = 0
        self.prompt = prompt
        self.hashes: list[int] = []  # full blocks' hashes (request.block_hashes)
        self.blocks: list[int] = []  # block ids in the pool (req_to_blocks)
        self.n_cached_blocks = 0  # of them, how many are cached (num_cached_block)
        self.n_out = 0
        self.tokens: list[int] = []
        self.states: list[int] = []  # the state before each token (model.top_logprobs)
        self.done = False
        self.finish: str | None = None
        self.stop_reason: int | str | None = None
        self.cancelled = False
        self.arrival = time.monotonic()
        self.scheduled_ts = 0.0
        self.first_ts = 0.0
        self.last_ts = 0.0
        run.seqs.append(self)

    @property
    def kv_blocks(self) -> int:
        return math.ceil((self.prompt_len + self.n_out) / BLOCK_SIZE)

    def mark_scheduled(self, now: float) -> None:
        if not self.scheduled_ts:
            self.scheduled_ts = now
            self._admit()

    def _admit(self) -> None:
        """The prefix-cache lookup of a request's admission (checked against vLLM 0.31.0
        ``v1/core/sched/scheduler.py`` ``schedule``, ``kv_cache_manager.py``
        ``get_computed_blocks`` and ``record_prefix_cache_stats``): the longest cached run of
        the prompt's full blocks, up to ``num_tokens - 1`` tokens ("we must recompute the last
        token to obtain logits": a fully cached prompt recomputes its last block), then the
        connector's tokens past it; ``vllm:prefix_cache_queries``/``_hits`` count the prompt
        and the local hit when caching is on (no lookup, no count, when off), the connector's
        ``vllm:external_prefix_cache_*`` what the local hit left and what the connector brought."""
        run = self.run
        m = run.metrics
        cache = run.cache
        hit: list[int] = []
        if cache is not None:
            self.hashes = block_hashes(self.prompt)
            hit = cache.lookup(self.hashes, (self.prompt_len - 1) // BLOCK_SIZE)
            cache.touch(hit)
            self.blocks = hit
            self.n_cached_blocks = len(hit)
            m.prefix_queries.inc(self.prompt_len)
            m.prefix_hits.inc(len(hit) * BLOCK_SIZE)
        self.local_hit = len(hit) * BLOCK_SIZE
        self.external = max(0, self.external - self.local_hit)
        if run.connector:  # connector_prefix_cache_queries / _hits
            m.ext_queries.inc(self.prompt_len - self.local_hit)
            m.ext_hits.inc(self.external)
        self.prefill_left = self.prompt_len - self.local_hit - self.external

    def schedule(self, take: int) -> None:
        """This step computes ``take`` more tokens (a prompt chunk, or the one decode token):
        ``kv_cache_manager.py`` ``allocate_slots`` gives the sequence blocks for them and
        caches every block they fill, ``min(computed + new, num_tokens)`` tokens, at once (so
        a request admitted later in the same step already hits them): the prompt's blocks,
        a connector's included, then generated tokens' blocks."""
        cache = self.run.cache
        if cache is None:
            return
        if self.n_out:  # decoding: the last sampled token goes in
            upto = self.prompt_len + self.n_out
        else:
            upto = self.prompt_len - self.prefill_left + take
        blocks = self.blocks
        while upto > len(blocks) * BLOCK_SIZE:
            blocks.append(cache.new_block())
        full = upto // BLOCK_SIZE
        if full <= self.n_cached_blocks:  # most decode steps: no block filled
            return
        hashes = self.hashes
        while len(hashes) < full:  # a block of generated tokens (or straddling the prompt's end)
            start = len(hashes) * BLOCK_SIZE
            ids = self.prompt[start : start + BLOCK_SIZE]
            cut = max(0, start - self.prompt_len)
            ids += self.tokens[cut : cut + BLOCK_SIZE - len(ids)]
            hashes.append(hash_block(hashes[-1] if hashes else None, ids))
        new = [i for i in range(self.n_cached_blocks, full) if cache.cache(blocks[i], hashes[i])]
        if new and cache.events is not None:  # one BlockStored per run of new blocks
            for run in _runs(new):
                first, end = run[0], run[-1] + 1
                ids = (self.prompt + self.tokens[: max(0, end * BLOCK_SIZE - self.prompt_len)])[
                    first * BLOCK_SIZE : end * BLOCK_SIZE
                ]
                cache.events.stored(hashes[first:end], hashes[first - 1] if first else None, ids)
        self.n_cached_blocks = full

    def free(self) -> None:
        """``kv_cache_manager.py`` ``free``: the blocks back to the pool, the tail first."""
        cache = self.run.cache
        if cache is not None and self.blocks:
            blocks, self.blocks = self.blocks, []
            cache.free_blocks(blocks[::-1])

    def emit(self, now: float) -> Event:
        """Sample the next token, apply vLLM's stop checks, record it and queue its event."""
        self.mark_scheduled(now)
        suppress = self.n_out < self.min_tokens
        state = self.gen.h
        tok = self.gen.step(suppress, self.stop_ids if suppress else frozenset())
        self.n_out += 1
        self.tokens.append(tok)
        self.states.append(state)
        # v1/core/sched/utils.py check_stop (0.31): EOS, then stop token ids, then length
        finish: str | None = None
        stop_reason: int | str | None = None
        if tok == M.EOS:
            finish = "stop"
        elif tok in self.stop_ids:
            finish, stop_reason = "stop", tok
        elif self.n_out >= self.max_tokens or self.prompt_len + self.n_out >= self.max_model_len:
            finish = "length"
        # v1/engine/output_processor.py: then the detokenizer's stop strings
        matched = self.text.add(tok, finish == "stop")
        if matched is not None:
            finish, stop_reason = "stop", matched
        self.finish = finish
        self.stop_reason = stop_reason
        self.done = finish is not None
        if self.done:
            self.free()
        ev = Event(self.index, tok, self.text.delta(self.done), finish, stop_reason, state)
        self._record(now)
        if not self.run.direct:
            self.run.queue.put_nowait(ev)
        return ev

    def _record(self, now: float) -> None:
        """vllm/v1/metrics/stats.py IterationStats.update_from_output and
        update_from_finished_request (0.31)."""
        m = self.run.metrics
        m.generation_tokens.inc()
        computed = 1 if self.n_out > 1 else self.prompt_len - self.local_hit - self.external
        m.work(max(1, computed), self.prompt_len + self.n_out)
        if self.n_out == 1:
            # stats.py PrefillStats.set / PromptTokenStats (0.31): local hit and connector
            # tokens as admission found them, the rest computed
            cached = self.local_hit + self.external
            m.prompt_tokens.inc(self.prompt_len)
            m.prompt_by_source["local_compute"].inc(self.prompt_len - cached)
            m.prompt_by_source["local_cache_hit"].inc(self.local_hit)
            m.prompt_by_source["external_kv_transfer"].inc(self.external)
            m.prompt_cached.inc(cached)
            m.ttft.observe(now - self.arrival)
            self.first_ts = now
        else:
            m.itl.observe(now - self.last_ts)
        self.last_ts = now
        if not self.done:
            return
        decode = self.last_ts - self.first_ts
        m.success[self.finish or "length"].inc()
        m.e2e.observe(now - self.arrival)
        m.queue.observe(self.scheduled_ts - self.arrival)
        m.prefill.observe(self.first_ts - self.scheduled_ts)
        m.decode.observe(decode)
        m.inference.observe(self.last_ts - self.scheduled_ts)
        m.preemptions.observe(0)
        m.kv_computed.observe(self.prompt_len - self.local_hit - self.external)
        m.req_prompt.observe(self.prompt_len)
        m.req_gen.observe(self.n_out)
        m.tpot.observe(decode / (self.n_out - 1) if self.n_out > 1 else 0)
        if self.max_tokens:
            m.params_max_tokens.observe(self.max_tokens)
        self.run._child_finished()


class Engine:
    """The step loop (see the module docstring); only runs when some delay is configured."""

    def __init__(self, cfg: Any, state: dict[str, Any], metrics: VllmMetrics) -> None:
        self.cfg = cfg
        self.state = state
        self.metrics = metrics
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        # how a step's duration passes (tests record it instead)
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self.busy_s = 0.0  # seconds of steps so far (pd_sim_busy_seconds_total)

    @property
    def zero_delay(self) -> bool:
        c = self.cfg
        return (
            c.prefill_ms_per_token == 0
            and c.decode_step_ms == 0
            and c.decode_step_ms_per_seq == 0
            and self.state["fault"] != "slow"
        )

    def _factor(self) -> float:
        return self.cfg.slow_factor if self.state["fault"] == "slow" else 1.0

    def submit(self, seqs: list[Seq]) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        self.waiting.extend(seqs)
        self.wake.set()

    def num_waiting(self) -> int:
        return sum(1 for s in self.waiting if not s.cancelled)

    def _schedule(self, now: float) -> list[tuple[Seq, int, bool]]:
        c = self.cfg
        budget = c.max_num_batched_tokens
        batch: list[tuple[Seq, int, bool]] = []
        for s in self.running:
            if budget <= 0:
                break
            take = min(s.prefill_left, budget) if s.prefill_left else 1
            s.schedule(take)
            batch.append((s, take, s.prefill_left > 0))
            budget -= take
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            s = self.waiting.popleft()
            if s.cancelled:
                continue
            s.mark_scheduled(now)  # admission: the prefix-cache lookup sets prefill_left
            take = min(s.prefill_left, budget)
            s.schedule(take)
            self.running.append(s)
            batch.append((s, take, True))
            budget -= take
        return batch

    def _step_ms(self, prefill: int, decodes: int) -> float:
        """One step's duration (ms) before ``slow_factor``; see the module docstring."""
        c = self.cfg
        if getattr(c, "step_time", "sum") == "max":
            memory = c.decode_step_ms + c.decode_step_ms_per_seq * decodes
            return max(c.prefill_ms_per_token * (prefill + decodes), memory)
        ms = c.prefill_ms_per_token * prefill
        if decodes:
            ms += c.decode_step_ms + c.decode_step_ms_per_seq * decodes
        return ms

    async def _run(self) -> None:
        while True:
            self.running = [s for s in self.running if not (s.cancelled or s.done)]
            while self.waiting and self.waiting[0].cancelled:
                self.waiting.popleft()
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            batch = self._schedule(time.monotonic())
            prefill = sum(take for _, take, is_prefill in batch if is_prefill)
            decodes = sum(1 for _, _, is_prefill in batch if not is_prefill)
            ms = self._step_ms(prefill, decodes)
            self.busy_s += ms * self._factor() / 1000
            await self.sleep(ms * self._factor() / 1000)
            now = time.monotonic()
            sampled = 0
            for s, take, is_prefill in batch:
                if s.cancelled or s.done:
                    continue
                if is_prefill:
                    s.prefill_left -= take
                    if s.prefill_left:
                        continue
                s.emit(now)
                sampled += 1
            self.metrics.iteration.observe(prefill + sampled)
