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

Not modelled: preemption and KV-cache capacity limits on admission, prefix caching (every
prompt token not delivered by a KV connector is computed), ``long_prefill_token_threshold``,
speculative decoding, async scheduling.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_router_dev.sim import model as M

if TYPE_CHECKING:
    from pd_router_dev.sim.metrics import VllmMetrics

BLOCK_SIZE = 16  # config/cache.py (0.31) CacheConfig.DEFAULT_BLOCK_SIZE


@dataclass(slots=True)
class Event:
    """One sampled token of one choice, as the front end turns it into output."""

    index: int
    token: int
    text: str  # text released by this token (stop-string hold-back applied)
    finish: str | None
    stop_reason: int | str | None


class Run:
    """The sequences of one HTTP request (``n`` choices per prompt) and their events."""

    def __init__(self, metrics: VllmMetrics, n: int) -> None:
        self.metrics = metrics
        self.n = n
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
        "cancelled",
        "done",
        "finish",
        "first_ts",
        "gen",
        "index",
        "last_ts",
        "max_model_len",
        "max_tokens",
        "min_tokens",
        "n_out",
        "prefill_left",
        "prompt_index",
        "prompt_len",
        "run",
        "scheduled_ts",
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
    ) -> None:
        self.run = run
        self.index = index
        self.prompt_index = prompt_index
        self.gen = M.Generator(prompt, ignore_eos, choice)
        self.text = M.TextState(stop or [], include_stop_str_in_output, min_tokens)
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.min_tokens = min_tokens
        self.stop_ids = frozenset(stop_token_ids or ())
        self.uncached = uncached
        self.prefill_left = max(uncached, 1)  # the last prompt token is always computed
        self.n_out = 0
        self.tokens: list[int] = []
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
            self.run.metrics.prefix_queries.inc(self.prompt_len)

    def emit(self, now: float) -> Event:
        """Sample the next token, apply vLLM's stop checks, record it and queue its event."""
        self.mark_scheduled(now)
        suppress = self.n_out < self.min_tokens
        tok = self.gen.step(suppress, self.stop_ids if suppress else frozenset())
        self.n_out += 1
        self.tokens.append(tok)
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
        ev = Event(self.index, tok, self.text.delta(self.done), finish, stop_reason)
        self._record(now)
        if not self.run.direct:
            self.run.queue.put_nowait(ev)
        return ev

    def _record(self, now: float) -> None:
        """vllm/v1/metrics/stats.py IterationStats.update_from_output and
        update_from_finished_request (0.31)."""
        m = self.run.metrics
        m.generation_tokens.inc()
        if self.n_out == 1:
            computed = min(self.prompt_len, max(self.uncached, 1))
            cached = self.prompt_len - computed
            m.prompt_tokens.inc(self.prompt_len)
            m.prompt_by_source["local_compute"].inc(computed)
            m.prompt_by_source["external_kv_transfer"].inc(cached)
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
        m.kv_computed.observe(min(self.prompt_len, max(self.uncached, 1)))
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
        self.sleep = asyncio.sleep  # how a step's duration passes (tests record it instead)

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
            batch.append((s, take, s.prefill_left > 0))
            budget -= take
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            s = self.waiting.popleft()
            if s.cancelled:
                continue
            s.mark_scheduled(now)
            take = min(s.prefill_left, budget)
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
