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
# Spread of a predicted step time (standard deviation of log(observed / predicted)): how sure a
# step that carries a chunk is to be past the ITL bound.
STEP_SPREAD = 0.2
MAX_CHUNKS = 64  # chunks of a prompt weighed one by one (the rest at the last one's rate)
PRIOR_FADE = 0.9  # a prefill fit's prior weighs a tenth of a sample after about 30 samples
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


class PrefillFit:
    """A prefill's time against the prompts it waits behind and its own: ``a + k x sum(n) +
    q x sum(n^2)`` over the uncached tokens ``n`` of each (attention's cost grows with the
    square of a prompt's length: on the CPU build a 2,500-token prompt takes 0.15 ms a token,
    a 200-token one 0.12), by least squares with :class:`Fit`'s forgetting. Its prior line
    (q = 0) weighs ``PRIOR_WEIGHT`` samples and fades faster than samples do
    (``PRIOR_FADE`` each), so that a prior far from the engine's truth cannot bend the curve
    at lengths no sample has reached yet for long."""

    __slots__ = ("a", "b", "m", "mp", "n", "pw", "q", "v", "vp")

    def __init__(self, a: float, b: float, x0: float) -> None:
        self.a, self.b, self.q = a, b, 0.0
        self.n = 0
        # normal equations over (1, x, x2) in thousands of tokens: the samples' (m, v) and
        # the prior's at unit weight (mp, vp), weighed pw
        self.m = [[0.0] * 3 for _ in range(3)]
        self.v = [0.0] * 3
        self.mp = [[0.0] * 3 for _ in range(3)]
        self.vp = [0.0] * 3
        self.pw = PRIOR_WEIGHT
        for x in (x0 / 8, x0):  # two prior points on the line, a short and a long prompt
            _acc(self.mp, self.vp, (1.0, x / _K, x * x / _K2), a + b * x, 0.5)

    def add(self, x: float, x2: float, y: float) -> None:
        """A prefill of ``x`` tokens in all (``x2`` the sum of each prompt's square) took
        ``y`` seconds."""
        d = FORGET
        for row in self.m:
            row[0] *= d
            row[1] *= d
            row[2] *= d
        self.v = [e * d for e in self.v]
        _acc(self.m, self.v, (1.0, x / _K, x2 / _K2), y, 1.0)
        self.pw *= PRIOR_FADE
        self.n += 1
        pw = self.pw
        m = [[self.m[i][j] + pw * self.mp[i][j] for j in range(3)] for i in range(3)]
        v = [self.v[i] + pw * self.vp[i] for i in range(3)]
        sol = _solve3(m, v)
        if sol is None:
            return
        a, b, q = sol
        if q < 0 or b < 0:  # a cost falling with its load is noise: keep the line's fit
            q = 0.0
            sol2 = _solve2([r[:2] for r in m[:2]], v[:2])
            if sol2 is None:
                return
            a, b = sol2
            b = max(0.0, b)
        self.a, self.b, self.q = max(0.0, a), b / _K, q / _K2

    def __call__(self, x: float, x2: float) -> float:
        return self.a + self.b * x + self.q * x2


def _acc(
    m: list[list[float]], v: list[float], f: tuple[float, float, float], y: float, w: float
) -> None:
    for i in range(3):
        v[i] += w * f[i] * y
        for j in range(3):
            m[i][j] += w * f[i] * f[j]


_K = 1000.0  # PrefillFit's features in thousands of tokens (and millions of tokens squared)
_K2 = _K * _K


def _solve2(m: list[list[float]], v: list[float]) -> tuple[float, float] | None:
    det = m[0][0] * m[1][1] - m[0][1] * m[1][0]
    if abs(det) <= 1e-12 * abs(m[0][0] * m[1][1]) or det == 0:
        return None
    return ((v[0] * m[1][1] - m[0][1] * v[1]) / det, (m[0][0] * v[1] - m[1][0] * v[0]) / det)


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-300:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, 3):
            f = a[r][c] / a[c][c]
            for k in range(c, 4):
                a[r][k] -= f * a[c][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    if not all(math.isfinite(e) for e in x):
        return None
    return x[0], x[1], x[2]


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
        "queued_sq",
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
        slow_steps: float,
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
        self.queued_sq = 0  # ... the sum of their squares
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
            c.prefill.add(
                self.queued + self.tokens,
                self.queued_sq + self.tokens * self.tokens,
                self.t_end - self.t_send - self.step0,
            )


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
        "queued_sq",
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
        self.prefill = PrefillFit(PRIOR_PREFILL_OVERHEAD, 1.0 / tps, 4096.0)
        step = seed.decode_step_seconds or PRIOR_STEP
        self.step = Fit(step, PRIOR_STEP_PER_STREAM, 32.0)
        self.chunk = float(PRIOR_CHUNK_TOKENS)
        self.slow = Rate(tau)  # slow steps per second the prefills placed here cause
        self.slow_gap = 0.0  # mean duration of a gap past the bound, observed (0: none yet)
        self.itl_bound = g.itl_seconds
        self.queued = 0  # prompt tokens sent here and not yet prefilled
        self.queued_sq = 0  # the sum of their prompts' squares (PrefillFit)
        self.queued_slow = 0.0  # slow steps those prefills are expected to cause
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
        return self.step(self.decoding) + self.prefill(
            self.queued + tokens, self.queued_sq + tokens * tokens
        )

    def step_seconds(self, streams: int) -> float:
        return self.step(streams)

    def slow_steps(self, tokens: int) -> float:
        """The steps past the ITL bound that prefilling ``tokens`` here is expected to cause
        its decoding streams: each chunk of the prompt (vLLM's budget a step) takes a decode
        step plus its share of the prefill fit, and is past the bound with the chance a
        prediction that far from it is wrong (``STEP_SPREAD``): a prompt whose chunks all fit
        well within the bound stretches nothing, one near it a fraction of a step."""
        k, q = self.prefill.b, self.prefill.q
        s = self.step(self.decoding)
        bound = math.log(self.itl_bound)
        size = max(16.0, self.chunk)
        total, done, n = 0.0, 0.0, 0
        while done < tokens and n < MAX_CHUNKS:
            c = min(size, tokens - done)
            t = s + k * c + q * ((done + c) ** 2 - done**2)
            total += _above(math.log(t) - bound, STEP_SPREAD)
            done += c
            n += 1
        if done < tokens:  # the rest at the last chunk's rate
            total += (tokens - done) / size * _above(math.log(t) - bound, STEP_SPREAD)
        return total

    def slow_gap_seconds(self, tokens: int) -> float:
        """How long the first of those steps takes."""
        c = min(float(tokens), self.chunk)
        return self.step(self.decoding) + self.prefill.b * c + self.prefill.q * c * c

    def harm(self, slow_steps: float, now: float) -> float:
        """The expected number of streams decoding here that ``slow_steps`` more stretched
        steps push past their ITL p95: for each, the chance that the stretched steps still to
        come (those of the prefills queued ahead, then Poisson at this engine's slow-step rate
        over what it has left to decode) exceed its budget of slow gaps left, with these steps
        less without them. A stream already past its budget is not counted again; one with
        budget to spare costs a little, so prefills drift to where few streams decode."""
        if slow_steps <= 0.001:
            return 0.0
        # a fraction of a step: that chance of one more (whole steps and a part)
        whole = math.floor(slow_steps)
        part = slow_steps - whole
        ahead = self.queued_slow
        per_token = self.stretch(now) * self.step(self.decoding)
        total = 0.0
        for j in self.jobs:
            if not j.decoding or j.gaps >= j.out:
                continue
            left = math.floor(j.slow_budget - j.slow - ahead)
            if left < 0:
                continue
            future = per_token * (j.out - j.gaps)
            now_miss = poisson_above(future, left)
            more = poisson_above(future, left - whole) - now_miss
            if part:
                more += part * (poisson_above(future, left - whole - 1) - now_miss - more)
            total += more
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
        job.queued_sq = self.queued_sq
        job.step0 = self.step(self.decoding)
        if kind == "decode":
            job.decoding = True  # its first step only loads what was pulled
            self.decoding += 1
        else:
            if kind == "whole" and not stream:
                job.t_due = now + self.prefill_seconds(tokens)
                self.unseen.append(job)
            self.queued += tokens
            self.queued_sq += tokens * tokens
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
        self.queued_sq -= job.tokens * job.tokens
        self.queued_slow -= job.slow_steps
        if learn:
            self.prefill.add(
                job.queued + job.tokens,
                job.queued_sq + job.tokens * job.tokens,
                now - job.t_send - job.step0,
            )

    def first_token(self, job: Job, now: float) -> None:
        if job.kind == "whole":
            self._prefilled(job, now, True)
            job.decoding = True
            self.decoding += 1
        elif job.kind == "decode":
            # the pull and its first step, less the prompts queued ahead of it here
            waited = now - job.t_send - self.prefill.b * job.queued - self.prefill.q * job.queued_sq
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


def _above(z: float, spread: float) -> float:
    """The chance that a log-normal quantity predicted ``z`` (log units) from a bound is past
    it."""
    return 0.5 * (1.0 + math.erf(z / (spread * math.sqrt(2.0))))


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
