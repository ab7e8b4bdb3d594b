"""What each engine costs and carries, learnt online: the inputs of the goodput decision
(pd_router.plan). Nothing here is profiled offline; ``routing.goodput.seed`` only moves the
starting point, which the first observations overrule.

Per engine (:class:`EngineCosts`), from the router's own observations of its calls:

- **prefill**: seconds from sending a request until its first token (a whole request, streamed)
  or its prefill answer (a prefill leg), against the uncached prompt tokens the engine had to
  compute by then, this request's and those sent before it and not yet prefilled (vLLM admits
  waiting requests first come, first served: ``v1/core/sched/scheduler.py``, 0.31.0):
  ``seconds = step + a + k x tokens``, the step being the engine's decode step when it was
  sent (the batch it joins);
- **decode step**: the gap between two tokens of a stream on it while it prefills nothing,
  against the streams decoding on it: ``seconds = s0 + s1 x streams``;
- **chunk**: how many prompt tokens one step prefills at most (vLLM's chunked prefill,
  ``max_num_batched_tokens``; a step that carries a chunk takes ``step + k x chunk``), from the
  gaps a prefill stretched;
- **slow steps**: the decode steps per second stretched past ``routing.goodput.itlSeconds`` by
  the prefills placed on it (decayed over ``windowSeconds``): what a request decoding there
  should expect.

Pooled over the engines (one model, one kind of hardware): the **hand-off**, seconds from
sending a decode leg with a prefiller's ``kv_transfer_params`` until its first token, against
the tokens it pulls: ``seconds = h + t x tokens`` (the KV pull and the first step).

And what each engine carries now, from this router process's requests (:class:`Job`): prompt
tokens waiting to be prefilled, the prefills' slow steps still to come, and the streams
decoding (each with its output budget and the slow gaps it has seen, so that the decision can
tell which of them one more prefill would push past its ITL bound). Like the balancer's
in-flight counts, this is per router process: several workers or replicas each see their own
share (docs/router.md "The goodput decision").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from pd_router.config import Goodput
from pd_router.prefix import BYTES_PER_TOKEN

Clock = Callable[[], float]

# Built-in priors (routing.goodput.seed overrides): a mid-size model on one GPU, wrong by design
# until the first observations; each fit weighs its prior as PRIOR_WEIGHT samples.
PRIOR_PREFILL_TOKENS_PER_SECOND = 10000.0
PRIOR_PREFILL_OVERHEAD = 0.02
PRIOR_STEP = 0.02
PRIOR_STEP_PER_STREAM = 0.0002
PRIOR_HANDOFF = 0.03
PRIOR_HANDOFF_PER_TOKEN = 1e-6
# vLLM's max_num_batched_tokens for the OpenAI server below 70 GiB of device memory and on CPU
# (engine/arg_utils.py, 0.31.0); learnt from stretched gaps where larger
PRIOR_CHUNK_TOKENS = 2048
PRIOR_WEIGHT = 2.0
MEMORY = 64  # samples a fit remembers, about
FORGET = 1.0 - 1.0 / MEMORY
ITL_QUANTILE = 0.95  # the SLO is on each request's ITL p95 (DistServe's TPOT/ITL SLO)
# A request whose output budget is unknown (no max_tokens) is taken to decode this many tokens.
DEFAULT_OUTPUT_TOKENS = 256


class Fit:
    """``y = a + b x`` by least squares over samples each weighted ``FORGET`` times less than
    the next (a memory of about ``MEMORY`` samples: an engine's speed changes with what it runs,
    not with the clock, so an idle spell forgets nothing), starting from its prior as
    ``PRIOR_WEIGHT`` samples (two points on the prior line) that the samples outweigh in turn."""

    __slots__ = ("a", "b", "n", "sx", "sxx", "sxy", "sy", "w")

    def __init__(self, a: float, b: float, x0: float) -> None:
        h = PRIOR_WEIGHT / 2
        p1 = a + b * x0
        self.w = PRIOR_WEIGHT
        self.sx = h * x0
        self.sy = h * (a + p1)
        self.sxx = h * x0 * x0
        self.sxy = h * x0 * p1
        self.a, self.b = a, b
        self.n = 0  # samples seen

    def add(self, x: float, y: float) -> None:
        d = FORGET
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.n += 1
        det = self.w * self.sxx - self.sx * self.sx
        if det <= 1e-12 * self.w * self.sxx:  # alike samples: keep the slope, move the level
            self.a = max(0.0, (self.sy - self.b * self.sx) / self.w)
            return
        b = (self.w * self.sxy - self.sx * self.sy) / det
        if b < 0:  # costs grow with their load: a negative slope is noise; keep the mean
            b = 0.0
        self.b = b
        self.a = max(0.0, (self.sy - b * self.sx) / self.w)

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


class Rate:
    """Events per second, decayed over ``tau`` seconds."""

    __slots__ = ("_t", "tau", "v")

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.v = 0.0
        self._t = 0.0

    def add(self, n: float, now: float) -> None:
        self.v = self.value(now) + n / self.tau
        self._t = now

    def value(self, now: float) -> float:
        if not self._t:
            return 0.0
        return self.v * math.exp(-(now - self._t) / self.tau)


class Job:
    """One engine call of a request: its share of that engine's load until it ends, and what
    it teaches when it does. ``kind``: ``whole`` (prefills then decodes there), ``prefill`` (a
    prefill leg) or ``decode`` (a decode leg, its KV pulled from a prefiller)."""

    __slots__ = (
        "costs",
        "decoding",
        "ended",
        "gap_sum",
        "gaps",
        "kind",
        "out",
        "prefilled",
        "queued",
        "slow",
        "slow_budget",
        "slow_gap_sum",
        "slow_steps",
        "step0",
        "stream",
        "streams_sum",
        "t_due",
        "t_end",
        "t_first",
        "t_send",
        "tokens",
    )

    def __init__(
        self,
        costs: EngineCosts,
        kind: str,
        tokens: int,
        out: int,
        stream: bool,
        slow_steps: int,
        now: float,
    ) -> None:
        self.costs = costs
        self.kind = kind
        self.tokens = tokens  # prompt tokens this call computes (or pulls, for a decode leg)
        self.out = out  # output tokens it may decode
        self.stream = stream
        self.slow_steps = slow_steps  # its prefill's steps past the ITL bound
        self.t_send = now
        self.step0 = 0.0  # the engine's decode step when this was sent (part of its TTFT)
        self.t_first = 0.0
        self.t_due = 0.0  # a whole answer not streamed: when its prefill is taken to end
        self.t_end = 0.0
        self.queued = 0  # the engine's queued prefill tokens when this was sent
        self.decoding = False
        self.prefilled = kind == "decode"  # its prompt is no longer in the engine's queue
        self.ended = False
        self.gaps = 0
        self.slow = 0  # gaps past the ITL bound seen so far
        self.gap_sum = 0.0  # of the gaps within the bound
        self.slow_gap_sum = 0.0
        self.streams_sum = 0  # streams decoding on the engine, summed over the gaps counted
        # slow gaps it may see and still meet its ITL p95
        self.slow_budget = int((1 - ITL_QUANTILE) * max(1, out))

    def first(self, now: float) -> None:
        """Its first token (a stream's) reached the router."""
        if self.t_first or self.ended:
            return
        self.t_first = now
        c = self.costs
        c.first_token(self, now)

    def gap(self, dt: float) -> None:
        """One more chunk of its stream, ``dt`` seconds after the one before."""
        c = self.costs
        self.gaps += 1
        if dt > c.itl_bound:
            self.slow += 1
            self.slow_gap_sum += dt
        else:
            self.gap_sum += dt
            self.streams_sum += c.decoding

    def end(self) -> None:
        """The call is over (its lease released), however it went."""
        if not self.ended:
            self.ended = True
            self.t_end = self.costs.clock()
            self.costs.ended(self, self.t_end)

    def answered(self) -> None:
        """A prefill leg answered well: its time teaches the prefill fit."""
        if self.kind == "prefill" and self.ended:
            c = self.costs
            c.prefill.add(self.queued + self.tokens, self.t_end - self.t_send - self.step0)


class EngineCosts:
    """One engine's fits and what it carries (see the module docstring)."""

    __slots__ = (
        "chunk",
        "clock",
        "decoding",
        "itl_bound",
        "jobs",
        "model",
        "prefill",
        "queued",
        "queued_slow",
        "slow",
        "slow_gap",
        "step",
        "unseen",
    )

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.clock = model.clock
        g = model.cfg
        tau = g.window_seconds
        seed = g.seed
        tps = seed.prefill_tokens_per_second or PRIOR_PREFILL_TOKENS_PER_SECOND
        self.prefill = Fit(PRIOR_PREFILL_OVERHEAD, 1.0 / tps, 4096.0)
        step = seed.decode_step_seconds or PRIOR_STEP
        self.step = Fit(step, PRIOR_STEP_PER_STREAM, 32.0)
        self.chunk = float(PRIOR_CHUNK_TOKENS)
        self.slow = Rate(tau)  # slow steps per second the prefills placed here cause
        self.slow_gap = 0.0  # mean duration of a gap past the bound, observed (0: none yet)
        self.itl_bound = g.itl_seconds
        self.queued = 0  # prompt tokens sent here and not yet prefilled
        self.queued_slow = 0  # slow steps those prefills will cause
        self.decoding = 0  # streams decoding here
        self.jobs: set[Job] = set()
        # whole answers not streamed: the router never sees their first token, so each leaves
        # the queue when its prefill was predicted to end (refresh)
        self.unseen: list[Job] = []

    def refresh(self, now: float) -> None:
        """Move the unseen whole answers whose prefill should be over to decoding."""
        if not self.unseen:
            return
        keep = []
        for j in self.unseen:
            if j.ended:
                continue
            if now >= j.t_due:
                self._prefilled(j, now, False)
                j.decoding = True
                self.decoding += 1
            else:
                keep.append(j)
        self.unseen = keep

    # ------------------------------------------------------------------ predictions
    def prefill_seconds(self, tokens: float) -> float:
        """Until the first token of a prompt of ``tokens`` uncached tokens sent now: the step
        running (its decodes batched with the chunks), then the prompts queued ahead and this
        one."""
        return self.step(self.decoding) + self.prefill(self.queued + tokens)

    def step_seconds(self, streams: int) -> float:
        return self.step(streams)

    def slow_steps(self, tokens: int) -> int:
        """Steps past the ITL bound that prefilling ``tokens`` here causes its decoding streams:
        none when one chunk of it fits in the bound."""
        k = self.prefill.b
        s = self.step(self.decoding)
        chunk = min(float(tokens), self.chunk)
        if s + k * chunk <= self.itl_bound:
            return 0
        return max(1, math.ceil(tokens / self.chunk))

    def slow_gap_seconds(self, tokens: int) -> float:
        """How long one of those steps takes."""
        k = self.prefill.b
        return self.step(self.decoding) + k * min(float(tokens), self.chunk)

    def harm(self, slow_steps: int, now: float) -> float:
        """The expected number of streams decoding here that ``slow_steps`` more stretched
        steps push past their ITL p95: for each, the chance that the stretched steps still to
        come (those of the prefills queued ahead, then Poisson at this engine's slow-step rate
        over what it has left to decode) exceed its budget of slow gaps left, with these steps
        less without them. A stream already past its budget is not counted again; one with
        budget to spare costs a little, so prefills drift to where few streams decode."""
        if slow_steps <= 0:
            return 0.0
        ahead = self.queued_slow
        per_token = self.stretch(now) * self.step(self.decoding)
        total = 0.0
        for j in self.jobs:
            if not j.decoding or j.gaps >= j.out:
                continue
            left = j.slow_budget - j.slow - ahead
            if left < 0:
                continue
            future = per_token * (j.out - j.gaps)
            total += poisson_above(future, left - slow_steps) - poisson_above(future, left)
        return total

    def stretch(self, now: float) -> float:
        """Stretched gaps to expect per decode step a stream spends here: the slow-step rate
        over the time a token takes, which the stretched steps lengthen in turn (an engine
        prefilling a share ``r x gap`` of its time decodes ``1 - r x gap`` of it)."""
        rate = self.slow.value(now)
        if rate <= 0:
            return 0.0
        gap = self.slow_gap or self.slow_gap_seconds(int(self.chunk))
        return rate / max(0.1, 1.0 - rate * gap)

    # ------------------------------------------------------------------ bookkeeping
    def start(self, kind: str, tokens: int, out: int, stream: bool, now: float) -> Job:
        slow = self.slow_steps(tokens) if kind != "decode" else 0
        job = Job(self, kind, tokens, out, stream, slow, now)
        job.queued = self.queued
        job.step0 = self.step(self.decoding)
        if kind == "decode":
            job.decoding = True  # its first step only loads what was pulled
            self.decoding += 1
        else:
            if kind == "whole" and not stream:
                job.t_due = now + self.prefill_seconds(tokens)
                self.unseen.append(job)
            self.queued += tokens
            self.queued_slow += slow
            if slow:
                self.slow.add(slow, now)
        self.jobs.add(job)
        return job

    def _prefilled(self, job: Job, now: float, learn: bool) -> None:
        """``job``'s prompt is prefilled: out of the queue; ``learn``: its time teaches the
        prefill fit (the queue it waited behind and its own tokens)."""
        if job.prefilled:
            return
        job.prefilled = True
        self.queued -= job.tokens
        self.queued_slow -= job.slow_steps
        if learn:
            self.prefill.add(job.queued + job.tokens, now - job.t_send - job.step0)

    def first_token(self, job: Job, now: float) -> None:
        if job.kind == "whole":
            self._prefilled(job, now, True)
            job.decoding = True
            self.decoding += 1
        elif job.kind == "decode":
            # the pull and its first step, less the prompts queued ahead of it here
            waited = now - job.t_send - self.prefill.b * job.queued
            self.model.handoff.add(job.tokens, waited)

    def ended(self, job: Job, now: float) -> None:
        self.jobs.discard(job)
        # out of the queue; what it teaches is told apart (Job.first, Job.answered): a call
        # that failed teaches nothing
        self._prefilled(job, now, False)
        if job.decoding:
            self.decoding -= 1
        gaps = job.gaps - job.slow
        if gaps > 0:
            self.step.add(job.streams_sum / gaps, job.gap_sum / gaps)
        if job.slow:
            mean = job.slow_gap_sum / job.slow
            self.slow_gap = mean if not self.slow_gap else 0.8 * self.slow_gap + 0.2 * mean
            # a gap shorter than a whole pending prefill would take was cut by the chunk budget
            k = self.prefill.b
            if k > 0:
                tokens = (mean - self.step(self.decoding)) / k
                if tokens > 16:
                    self.chunk = 0.8 * self.chunk + 0.2 * tokens


def poisson_above(mean: float, k: int) -> float:
    """P(N > k) for N ~ Poisson(``mean``) (1 for k < 0): the chance of more stretched gaps
    than a budget of ``k``."""
    if k < 0:
        return 1.0
    if mean <= 0:
        return 0.0
    if mean > 50:  # normal approximation, continuity-corrected
        z = (k + 0.5 - mean) / math.sqrt(mean)
        return 0.5 * (1.0 - math.erf(z / math.sqrt(2.0)))
    term = math.exp(-mean)
    total = term
    for i in range(1, k + 1):
        term *= mean / i
        total += term
        if total >= 1.0:
            break
    return max(0.0, 1.0 - total)


class CostModel:
    """The fits and loads of every engine this router process sends to, and the pooled
    hand-off fit (see the module docstring)."""

    def __init__(self, cfg: Goodput, clock: Clock = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        seed = cfg.seed
        h = seed.handoff_seconds or PRIOR_HANDOFF
        self.handoff = Fit(h, PRIOR_HANDOFF_PER_TOKEN, 4096.0)
        self._engines: dict[tuple[str, int], EngineCosts] = {}
        # UTF-8 bytes per token of the prompts counted exactly: sizes the prompts that are not
        # (pd_router.decide, a short prompt weighed at its upper bound)
        self.bytes_per_token = float(BYTES_PER_TOKEN)

    def counted(self, nbytes: int, tokens: int) -> None:
        """A prompt of ``nbytes`` bytes was counted at ``tokens`` tokens."""
        if nbytes > 0 and tokens > 0:
            self.bytes_per_token = 0.9 * self.bytes_per_token + 0.1 * (nbytes / tokens)

    def estimate(self, nbytes: int) -> int:
        """The tokens of a prompt of ``nbytes`` bytes, by the prompts counted so far."""
        return max(1, round(nbytes / self.bytes_per_token))

    def of(self, base: str, generation: int) -> EngineCosts:
        """The costs of an engine in its current life (a restarted engine is learnt afresh)."""
        key = (base, generation)
        c = self._engines.get(key)
        if c is None:
            c = self._engines[key] = EngineCosts(self)
            for k in [k for k in self._engines if k[0] == base and k[1] < generation]:
                del self._engines[k]
        return c

    def ttft_bound(self, prompt_tokens: int) -> float:
        g = self.cfg
        return g.ttft_seconds + g.ttft_seconds_per_kilo_token * prompt_tokens / 1000.0


class Meter:
    """One request's tie to the cost model: each engine call of it starts a :class:`Job`
    sized by what the decision learnt (the prompt's tokens, those each engine holds, the output
    budget); a call to an engine the decision did not weigh (a retry) counts the whole prompt."""

    __slots__ = ("held", "model", "out", "predicted_ttft", "stream", "tokens")

    def __init__(
        self,
        model: CostModel,
        tokens: int,
        held: dict[str, int],
        out: int,
        stream: bool,
        predicted_ttft: float,
    ) -> None:
        self.model = model
        self.tokens = tokens
        self.held = held  # engine base URL -> prompt tokens it holds
        self.out = out
        self.stream = stream
        self.predicted_ttft = predicted_ttft  # from the decision, seconds

    def job(self, base: str, generation: int, kind: str) -> Job:
        """A call of ``kind`` to that engine, sent now (its Lease ends it)."""
        tokens = max(1, self.tokens - self.held.get(base, 0))
        c = self.model.of(base, generation)
        return c.start(kind, tokens, self.out if kind != "prefill" else 0, self.stream, c.clock())
