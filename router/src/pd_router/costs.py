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
  against the streams decoding on it and the share of the other engines at work:
  ``seconds = (s0 + s1 x streams) x (1 + crowding x share)`` (:class:`StepFit`; the
  crowding is 0 for engines on GPUs of their own, 2-3 for this project's CPU engines, which
  share a machine);
- **stall**: what a prompt token adds to the step that prefills it, from the gap of a stream
  that ended with the step that produced a prompt's first token (vLLM's chunked prefill cuts a
  long prompt into chunks of ``max_num_batched_tokens``, ``seed.chunkTokens``, each a step);
- **slow steps**: the decode steps per second stretched past ``routing.goodput.itlSeconds`` by
  the prefills placed on it (decayed over ``windowSeconds``): what a request decoding there
  should expect.

Pooled over the engines (one model, one kind of hardware): the **hand-off**, seconds from
sending a decode leg with a prefiller's ``kv_transfer_params`` until its first token, against
the tokens it pulls: ``seconds = h + t x tokens`` (the KV pull and the first step); and a
**prefill** fit over every engine's samples, towards whose per-token costs each engine's own
is held (``LEAN_WEIGHT``, firm): an engine that has prefilled only short prompts, one step
each, learns what its steps cost but not what a token does, and prices a long prompt from
the engines that prefilled long ones.

And the **calls placed on each engine**, per second over the window, by the TTFT slack each
was placed with (``SLACK_BUCKETS``): what a prefill there holds up (pd_router.plan).

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
from collections.abc import Callable, Sequence

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
# (engine/arg_utils.py, 0.31.0; 8192 on H100/H200): routing.goodput.seed.chunkTokens otherwise
PRIOR_CHUNK_TOKENS = 2048
PRIOR_WEIGHT = 2.0
# The calls placed on an engine are counted by their TTFT slack in buckets a factor of 2 apart,
# the first at a quarter of the TTFT bound's fixed part (ttftSeconds): what they can wait
SLACK_BUCKETS = 10
LEAN_WEIGHT = 0.25  # what a prefill fit's per-token prior weighs for good (PrefillFit._scale)
MEMORY = 64  # samples a fit remembers, about
FORGET = 1.0 - 1.0 / MEMORY
# Spread of a predicted step time (standard deviation of log(observed / predicted)): how sure a
# step that carries a chunk is to be past the ITL bound.
STEP_SPREAD = 0.2
# The shortest step a prediction takes, seconds: no engine decodes faster. The fits hold a
# coefficient that samples take below zero at 0, so a step could come out 0 (its intercept and
# per-stream cost both held), and the decision takes the log of steps: a flexible pool on the CPU
# engines answered a request 500 so (ValueError in Planner.crowding, 2026-12-07).
STEP_MIN = 1e-4
MAX_CHUNKS = 64  # chunks of a prompt weighed one by one (the rest at the last one's rate)
# Gaps an engine's observed share of slow gaps is held towards the prefills' prediction by,
# until that many were seen over the window.
SEEN_PRIOR = 20.0
# A stall sample needs a stream's gap to end within this many decode steps of a first token.
STEP_MATCH = 0.5
STALL_PRIOR = 1.0  # stall samples the prefill fit's k counts as (see EngineCosts.stall_per_token)
# A crowding (StepFit.crowding) below this is taken as none: engines on GPUs of their own learn
# a few hundredths from noise; engines sharing a machine, 1 or more.
CROWD_MIN = 0.1
# From this crowding on, two engines at work each decode at least twice as slowly as one alone,
# and so serve no more than it: the goodput decision then keeps work on one engine while it can
# (pd_router.plan.WAKE). Engines on GPUs of their own learn well under it (the simulated H100s:
# 0.43 at most); this project's CPU engines 1-3.7.
CROWD_CONSOLIDATE = 1.0
# A prefill fit is solved (a 4 x 4 system, ~30 us in Python) at most this often per engine:
# samples that come faster are summed at once and reflected by the next decision after it.
SOLVE_SECONDS = 0.05
PRIOR_FADE = 0.9  # a prefill fit's prior weighs a tenth of a sample after about 30 samples
# Fewer stretched steps than this harm no stream that counts (EngineCosts.harm).
HARM_NEGLIGIBLE = 0.001
# An engine's arrivals are weighed as of a reference time and scaled up as time goes on (one
# exp a call, not one per bucket): brought back to now past this many windows.
REBASE_TAUS = 32.0
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


def _accumulate(m: list[list[float]], v: list[float], f: Sequence[float], y: float) -> None:
    """Fold the sample ``(f, y)`` into the forgetting sums ``m`` (symmetric: each product
    once) and ``v``."""
    d = FORGET
    k = len(v)
    for i in range(k):
        fi = f[i]
        v[i] = v[i] * d + fi * y
        row = m[i]
        for j in range(i, k):
            e = row[j] * d + fi * f[j]
            row[j] = m[j][i] = e


def _accumulate3(m: list[list[float]], v: list[float], f: Sequence[float], y: float) -> None:
    d = FORGET
    f0, f1, f2 = f
    r0, r1, r2 = m
    v[0] = v[0] * d + f0 * y
    v[1] = v[1] * d + f1 * y
    v[2] = v[2] * d + f2 * y
    r0[0] = r0[0] * d + f0 * f0
    r0[1] = r1[0] = r0[1] * d + f0 * f1
    r0[2] = r2[0] = r0[2] * d + f0 * f2
    r1[1] = r1[1] * d + f1 * f1
    r1[2] = r2[1] = r1[2] * d + f1 * f2
    r2[2] = r2[2] * d + f2 * f2


def _accumulate4(m: list[list[float]], v: list[float], f: Sequence[float], y: float) -> None:
    d = FORGET
    f0, f1, f2, f3 = f
    r0, r1, r2, r3 = m
    v[0] = v[0] * d + f0 * y
    v[1] = v[1] * d + f1 * y
    v[2] = v[2] * d + f2 * y
    v[3] = v[3] * d + f3 * y
    r0[0] = r0[0] * d + f0 * f0
    r0[1] = r1[0] = r0[1] * d + f0 * f1
    r0[2] = r2[0] = r0[2] * d + f0 * f2
    r0[3] = r3[0] = r0[3] * d + f0 * f3
    r1[1] = r1[1] * d + f1 * f1
    r1[2] = r2[1] = r1[2] * d + f1 * f2
    r1[3] = r3[1] = r1[3] * d + f1 * f3
    r2[2] = r2[2] * d + f2 * f2
    r2[3] = r3[2] = r2[3] * d + f2 * f3
    r3[3] = r3[3] * d + f3 * f3


_ACCUMULATE = {3: _accumulate3, 4: _accumulate4}


class Ridge:
    """Least squares over a few features with :class:`Fit`'s forgetting, each coefficient held
    towards its prior like ``weight`` samples at its feature's scale. That hold fades by
    ``PRIOR_FADE`` a sample (a prior far from the engine's truth cannot bend the fit for long
    where no sample has been), except for the coefficients in ``firm``, which keep it (they
    stay at their prior until the samples tell them apart from the others). A cost falling
    with its load is noise: a coefficient the solution takes below zero is held (at
    ``floor``) and the rest solved again without it; clamping it after the solve would leave
    the others fitted to a value it no longer has (a negative intercept absorbed by the
    per-step cost: every short prompt predicted slower by that much)."""

    __slots__ = ("accumulate", "beta", "beta0", "firm", "floor", "m", "n", "pending", "pw", "v")

    def __init__(
        self, beta0: Sequence[float], floor: Sequence[float], firm: Sequence[int] = ()
    ) -> None:
        k = len(beta0)
        self.beta0 = list(beta0)
        self.beta = list(beta0)
        self.floor = list(floor)
        self.firm = frozenset(firm)
        self.n = 0  # samples seen
        self.m = [[0.0] * k for _ in range(k)]
        self.v = [0.0] * k
        self.pw = PRIOR_WEIGHT
        self.pending = False  # samples added that the coefficients do not reflect yet
        # every sample of every call adds here (a prefill's twice, the pooled fit's too):
        # unrolled for the fits' sizes, a third of the loop's time
        self.accumulate = _ACCUMULATE.get(k, _accumulate)

    def observe(self, f: Sequence[float], y: float, solve: bool = True) -> None:
        """One sample: features ``f``, value ``y``; ``solve``: the coefficients follow now,
        else at the next :meth:`solve` (``pending`` until then)."""
        self.accumulate(self.m, self.v, f, y)
        self.pw *= PRIOR_FADE
        self.n += 1
        self.pending = True
        if solve:
            self.solve()

    def solve(self) -> None:
        """The coefficients from the samples so far."""
        self.pending = False
        m, v, k = self.m, self.v, len(self.v)
        mm = [row[:] for row in m]
        vv = v[:]
        for i in range(k):
            w = (PRIOR_WEIGHT if i in self.firm else self.pw) * self._scale(i)
            mm[i][i] += w
            vv[i] += w * self.beta0[i]
        held: dict[int, float] = {}
        while True:
            free = [i for i in range(k) if i not in held]
            sol = _solve(
                [[mm[i][j] for j in free] for i in free],
                [vv[i] - sum(mm[i][j] * h for j, h in held.items()) for i in free],
            )
            if sol is None:
                return
            beta = dict(held)
            beta.update(zip(free, sol, strict=True))
            low = [i for i in free if beta[i] < 0]
            if not low:
                break
            for i in low:
                held[i] = self.floor[i]
        self.beta = [beta[i] for i in range(k)]
        self._solved()

    def _solved(self) -> None:
        """The coefficients changed (subclasses keep them by name)."""

    def _scale(self, i: int) -> float:
        """A sample's typical square of feature ``i``: what a prior sample weighs there."""
        return 1.0


class PrefillFit(Ridge):
    """A prefill's time against what it waits behind and its own prompt: ``a + k x sum(n) +
    q x sum(n^2) + c x steps`` over the uncached tokens ``n`` of each prompt (attention's cost
    grows with the square of a prompt's length: on the CPU build a 2,500-token prompt takes
    0.15 ms a token, a 200-token one 0.1) and the steps they take (a step per chunk of vLLM's
    budget, each carrying the engine's decodes too), so that ``k`` and ``q`` are the prefill's
    own compute: what a chunk adds to a decode step. A :class:`Ridge` from the prior line
    (q = 0, c = the prior step); a per-token cost solved below zero is held at its prior."""

    __slots__ = ("a", "b", "c", "q")

    def __init__(self, a: float, b: float, step: float) -> None:
        # features in thousands of tokens (and millions squared): well conditioned. Held
        # towards the pooled fit (:meth:`lean_on`), the per-token costs are firm: an engine's
        # own samples outweigh that prior only where they tell them apart (prompts of many
        # lengths); towards the seed, they fade like the rest
        super().__init__([a, b * _K, 0.0, step], [0.0, b * _K, 0.0, 0.0])
        self.a, self.b, self.q, self.c = a, b, 0.0, step

    def _scale(self, i: int) -> float:
        # held towards the pooled fit, the per-token costs' firm prior weighs a quarter of a
        # sample of a 1,000-token prompt: next to nothing beside prompts of many lengths, most
        # of it beside one-step prompts of a few hundred tokens
        return LEAN_WEIGHT / PRIOR_WEIGHT if i in self.firm else 1.0

    def lean_on(self, pooled: PrefillFit) -> None:
        """Hold the per-token costs towards ``pooled``'s (every engine's samples: one model,
        one kind of hardware) rather than the seed: an engine that has prefilled only short
        prompts cannot tell what a token costs from the step each of them takes, and kept at
        the seed (0.1 ms a token) the short prompts' engine on the CPU machines predicted a
        2,153-token prompt at 0.39 s where the engine that prefilled the long ones said 2.0."""
        # not the seed's floor (its own per-token cost): on hardware faster than the seed the
        # pooled fit's is below it (the simulated H100s: 0.024 ms a token against 0.1)
        self.beta0[1] = max(0.0, pooled.beta[1])
        self.beta0[2] = max(0.0, pooled.beta[2])
        self.firm = _PER_TOKEN

    def add(self, x: float, x2: float, steps: float, y: float, solve: bool = True) -> None:
        """A prefill of ``x`` tokens in all (``x2`` the sum of each prompt's square) over
        ``steps`` steps took ``y`` seconds."""
        self.observe((1.0, x / _K, x2 / _K2, steps), y, solve)

    def _solved(self) -> None:
        a, b, q, c = self.beta
        self.a, self.b, self.q, self.c = a, b / _K, q / _K2, c

    def __call__(self, x: float, x2: float, steps: float) -> float:
        return self.a + self.b * x + self.q * x2 + self.c * steps


class StepFit(Ridge):
    """A decode step against the streams ``n`` decoding on the engine and the share ``b`` of
    the other engines at work: ``(s0 + s1 x n) x (1 + crowding x b)``. The crowding: engines
    that share a machine's cores, memory bandwidth or a host's router slow each other down
    (this project's CPU runs: each engine decodes 2-3 x slower while the other works); engines
    on GPUs of their own do not. Least squares over ``(1, n, b x the step alone)`` (the step
    alone as the fit had it before the sample: linear in what it solves for); the crowding is
    held at its prior (``seed.crowding``) like ``PRIOR_WEIGHT`` samples however many come, as
    only samples with the others both idle and at work tell it from the step alone."""

    __slots__ = ("crowding", "s0", "s1")

    def __init__(self, step: float, per_stream: float, crowding: float) -> None:
        super().__init__([step, per_stream, crowding], [0.0, 0.0, 0.0], firm=(2,))
        self.s0, self.s1, self.crowding = step, per_stream, crowding

    def add(self, n: float, b: float, gap: float, solve: bool = True) -> None:
        self.observe((1.0, n, b * (self.s0 + self.s1 * n)), gap, solve)

    def _solved(self) -> None:
        self.s0, self.s1, self.crowding = self.beta

    def __call__(self, n: float, b: float = 0.0) -> float:
        return max(STEP_MIN, (self.s0 + self.s1 * n) * (1.0 + self.crowding * b))

    def _scale(self, i: int) -> float:
        # the crowding's feature is a step (at b = 1): its prior weighs a sample of one
        return max(1e-6, self.s0 * self.s0) if i == 2 else 1.0


def seeded_prefill(cfg: Goodput) -> PrefillFit:
    """A prefill fit at its prior: ``routing.goodput.seed``, else the built-in one."""
    seed = cfg.seed
    tps = seed.prefill_tokens_per_second or PRIOR_PREFILL_TOKENS_PER_SECOND
    step = seed.decode_step_seconds or PRIOR_STEP
    return PrefillFit(PRIOR_PREFILL_OVERHEAD, 1.0 / tps, step)


_PER_TOKEN = frozenset((1, 2))  # PrefillFit's per-token coefficients (k and q)
_K = 1000.0  # PrefillFit's features in thousands of tokens (and millions of tokens squared)
_K2 = _K * _K


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-300:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    if not all(math.isfinite(e) for e in x):
        return None
    return x


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
        "ahead",
        "busy_sum",
        "costs",
        "decoding",
        "ended",
        "gap_sum",
        "gaps",
        "kind",
        "out",
        "prefilled",
        "slow",
        "slow_budget",
        "slow_gap_sum",
        "slow_steps",
        "step0",
        "steps",
        "stream",
        "streams_sum",
        "t_due",
        "t_end",
        "t_first",
        "t_send",
        "tokens",
        "usual",
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
        self.steps = costs.steps_of(tokens)  # the steps its prefill takes
        self.out = out  # output tokens it may decode
        self.stream = stream
        self.slow_steps = slow_steps  # its prefill's steps expected past the ITL bound
        self.t_send = now
        self.step0 = 0.0  # the engine's decode step when this was sent (part of its TTFT)
        self.ahead = (0, 0, 0)  # the engine's queue when this was sent: tokens, squares, steps
        self.t_first = 0.0
        self.t_due = 0.0  # a whole answer not streamed: when its prefill is taken to end
        self.t_end = 0.0
        self.decoding = False
        self.prefilled = kind == "decode"  # its prompt is no longer in the engine's queue
        self.ended = False
        self.gaps = 0
        self.slow = 0  # gaps past the ITL bound seen so far
        self.usual = 0  # gaps within twice the bound (what the step fit learns from)
        self.gap_sum = 0.0  # of those
        self.slow_gap_sum = 0.0  # of the gaps past the bound
        self.streams_sum = 0  # streams decoding on the engine, summed over the usual gaps
        self.busy_sum = 0.0  # the share of the other engines busy, summed over the usual gaps
        # slow gaps it may see and still meet its ITL p95
        self.slow_budget = int((1 - ITL_QUANTILE) * max(1, out))

    def first(self, now: float) -> None:
        """Its first token (a stream's) reached the router."""
        if self.t_first or self.ended:
            return
        self.t_first = now
        self.costs.first_token(self, now)

    def gap(self, dt: float, now: float) -> None:
        """One more chunk of its stream, ``dt`` seconds after the one before, at ``now``."""
        c = self.costs
        self.gaps += 1
        c.seen_gaps += 1
        c.saw_gap(dt, now)
        if dt > c.itl_bound:
            self.slow += 1
            self.slow_gap_sum += dt
            c.seen_slow += 1
        # a step slowed by the machine (or a short prefill) still teaches the step; a long
        # prefill's stall does not
        if dt <= 2 * c.itl_bound:
            self.usual += 1
            self.gap_sum += dt
            self.streams_sum += c.decoding
            m = c.model
            self.busy_sum += (m.busy - 1) * m.others_scale

    def end(self) -> None:
        """The call is over (its lease released), however it went."""
        if not self.ended:
            self.ended = True
            self.t_end = self.costs.clock()
            self.costs.ended(self, self.t_end)

    def answered(self) -> None:
        """A prefill leg answered well: its time teaches the prefill fit."""
        if self.kind == "prefill" and self.ended:
            self.costs.learn_prefill(self, self.t_end)


class EngineCosts:
    """One engine's fits and what it carries (see the module docstring)."""

    __slots__ = (
        "arrival_t",
        "arrivals",
        "base",
        "chunk",
        "chunk_size",
        "clock",
        "decoding",
        "gaps_d",
        "itl_bound",
        "jobs",
        "last_gap",
        "last_prefill",
        "log_itl_bound",
        "memo_share",
        "memo_share_at",
        "memo_stall",
        "memo_step",
        "memo_step_next",
        "memo_tick",
        "model",
        "next_due",
        "prefill",
        "q_sq",
        "q_steps",
        "q_tokens",
        "queued_slow",
        "reported",
        "seen_at",
        "seen_gaps",
        "seen_slow",
        "slow",
        "slow_d",
        "slow_gap",
        "solved_at",
        "stall_xx",
        "stall_xy",
        "step",
        "step_solved_at",
        "tau",
        "unseen",
    )

    def __init__(self, model: CostModel, base: str = "") -> None:
        self.model = model
        self.base = base
        self.reported = 0.0
        self.clock = model.clock
        g = model.cfg
        self.tau = g.window_seconds
        seed = g.seed
        self.prefill = seeded_prefill(g)
        self.solved_at = -math.inf  # when the prefill fit was last solved
        step = seed.decode_step_seconds or PRIOR_STEP
        self.step = StepFit(step, PRIOR_STEP_PER_STREAM, seed.crowding)
        self.step_solved_at = -math.inf
        # vLLM's max_num_batched_tokens: not said by the engine, nor learnt (the gaps a prompt
        # stretches show its chunks' cost, not where vLLM cut them); seed.chunkTokens sets it
        self.chunk = float(seed.chunk_tokens or PRIOR_CHUNK_TOKENS)
        self.chunk_size = max(16.0, self.chunk)  # a step's prompt tokens, as counted
        self.slow = Rate(self.tau)  # slow steps per second the prefills placed here cause
        # the calls the decisions placed here per second (decayed over the window, as of
        # arrival_t: :meth:`arrived`), by the TTFT slack they were placed with (their bound
        # less their predicted TTFT; CostModel.slack_bucket): what a prefill here holds up
        self.arrivals = [0.0] * SLACK_BUCKETS
        self.arrival_t = 0.0
        self.slow_gap = 0.0  # mean duration of a gap past the bound, observed (0: none yet)
        self.itl_bound = g.itl_seconds
        self.log_itl_bound = math.log(self.itl_bound)
        # the figures a decision asks of this engine a dozen times, kept while CostModel.tick
        # stays (:meth:`_remember`)
        self.memo_tick = -1
        self.memo_step = self.memo_step_next = self.memo_stall = self.memo_share = 0.0
        self.memo_share_at = math.nan
        # prompts sent here and not yet prefilled: their tokens, squares and steps
        self.q_tokens = 0
        self.q_sq = 0
        self.q_steps = 0
        self.queued_slow = 0.0  # slow steps those prefills are expected to cause
        self.decoding = 0  # streams decoding here
        self.jobs: set[Job] = set()
        # whole answers not streamed: the router never sees their first token, so each leaves
        # the queue when its prefill was predicted to end (refresh)
        self.unseen: dict[Job, None] = {}  # (a set in the order they came)
        self.next_due = math.inf  # the earliest of their due times (or earlier: one ended)
        # the gaps of its streams, and those past the ITL bound: counted as they come
        # (seen_*), folded into sums decayed over the window at each decision (*_d)
        self.seen_gaps = self.seen_slow = 0
        self.gaps_d = self.slow_d = 0.0
        self.seen_at = 0.0
        # what a prompt's last chunk added to the step that produced its first token, seen in
        # the gap of a stream on this engine that ended with that step: least squares through
        # the origin (stall = k x tokens), held towards the prefill fit's k like
        # STALL_PRIOR samples of a 256-token chunk
        self.stall_xy = self.stall_xx = 0.0
        self.last_prefill = (0.0, 0)  # (when, tokens) of the last first token seen here
        self.last_gap = (0.0, 0.0)  # (when it ended, how long) of the last gap seen here

    @property
    def queued(self) -> int:
        """Prompt tokens sent here and not yet prefilled."""
        return self.q_tokens

    def steps_of(self, tokens: int) -> int:
        size = self.chunk_size
        return 1 if tokens <= size else math.ceil(tokens / size)

    def refresh(self, now: float) -> None:
        """Fold the gaps counted since the last decision into the decayed sums; move the
        unseen whole answers whose prefill should be over to decoding. Once per instant: a
        decision weighs an engine several times at one ``now``."""
        if now == self.seen_at and not self.seen_gaps:
            return
        self.refresh_prefill(now)  # moves the tick where it solves
        if self.step.pending and now - self.step_solved_at >= SOLVE_SECONDS:
            self.step.solve()
            self._step_solved(now)
            self.model.tick += 1
        d = math.exp(-(now - self.seen_at) / self.tau) if self.seen_at else 1.0
        self.gaps_d = self.gaps_d * d + self.seen_gaps
        self.slow_d = self.slow_d * d + self.seen_slow
        # only this engine's share follows the gaps just folded: the tick, every engine's
        # figures, stays (refreshed at each new instant, each engine moved it a decision)
        self.memo_share_at = math.nan
        self.seen_at = now
        self.seen_gaps = self.seen_slow = 0
        report = self.model.report
        if report is not None and now - self.reported >= 1.0:
            self.reported = now
            b = self.base
            report(b, "prefill_seconds_per_token", self.prefill.b)
            report(b, "stall_seconds_per_token", self.stall_per_token())
            report(b, "decode_step_seconds", self.step_here())
            report(b, "crowding", self.step.crowding)
            report(b, "slow_gap_share", self.slow_share(now))
            report(b, "chunk_tokens", self.chunk)
        if now < self.next_due:  # no unseen answer's prefill is due yet
            return
        due = [j for j in self.unseen if now >= j.t_due]
        for j in due:
            del self.unseen[j]
            self._prefilled(j, now, False)
            j.decoding = True
            self.decoding += 1
        self.model.tick += 1
        self.next_due = min((j.t_due for j in self.unseen), default=math.inf)

    def arrived(self, slack: float, now: float) -> None:
        """A call placed here now, its request's TTFT slack ``slack`` seconds. One predicted
        past its bound already is not counted: a prefill placed ahead of it cannot make it
        late (counted in the lowest bucket, the doomed short prompts sent to an engine behind
        long prefills charged the next short prompt there for all of them, 3 misses)."""
        if not 0.0 < slack < math.inf:  # NaN too
            return
        w = self.arrivals
        if not self.arrival_t:
            self.arrival_t = now
        ahead = (now - self.arrival_t) / self.tau
        if ahead > REBASE_TAUS:  # weights as of now again, before their scale overflows
            d = math.exp(-ahead)
            for i in range(SLACK_BUCKETS):
                w[i] *= d
            self.arrival_t, ahead = now, 0.0
        w[self.model.slack_bucket(slack)] += math.exp(ahead) / self.tau

    def arrival_rate(self, now: float) -> float:
        """Calls placed here per second, over the window."""
        if not self.arrival_t:
            return 0.0
        return sum(self.arrivals) * math.exp(-(now - self.arrival_t) / self.tau)

    def refresh_prefill(self, now: float) -> None:
        """Solve the prefill fit for the samples it has not taken yet, at most every
        ``SOLVE_SECONDS``, held towards the pooled fit."""
        pooled = self.model.pooled_prefill(now)  # solved on its own clock, whatever ours
        if self.prefill.pending and now - self.solved_at >= SOLVE_SECONDS:
            if pooled is not None:
                self.prefill.lean_on(pooled)
            self.prefill.solve()
            self.solved_at = now
            self.model.tick += 1

    # ------------------------------------------------------------------ predictions
    def prefill_seconds(self, tokens: int) -> float:
        """Until the first token of a prompt of ``tokens`` uncached tokens sent now: the step
        running, then the prompts queued ahead and this one, their chunks each a step that
        carries the engine's decodes too."""
        return self.step_here() + self.prefill(
            self.q_tokens + tokens,
            self.q_sq + tokens * tokens,
            self.q_steps + self.steps_of(tokens),
        )

    def decode_miss(self, out: int, now: float) -> tuple[float, float]:
        """(step, chance of missing the ITL bound) of a stream of ``out`` tokens that starts
        decoding here now: its step alone past the bound is a miss; else more slow gaps than
        its budget, Poisson at this engine's share of slow gaps times its tokens."""
        step = self.step_next()
        if step > self.itl_bound:
            return step, 1.0
        return step, poisson_above(self.slow_share(now) * out, int((1 - ITL_QUANTILE) * out))

    def prefill_figures(self, tokens: int) -> tuple[float, float]:
        """(:meth:`prefill_seconds`, :meth:`slow_steps`) of a prompt of ``tokens`` uncached
        tokens, for a prompt of one chunk (most) in one frame: the goodput decision asks both
        of every engine it weighs, for every request (a test holds them equal to the two
        methods)."""
        if tokens > self.chunk_size or tokens <= 0:
            return self.prefill_seconds(tokens), self.slow_steps(tokens)
        if self.memo_tick != self.model.tick:
            self._remember()
        here = self.memo_step
        ttft = here + self.prefill(
            self.q_tokens + tokens, self.q_sq + tokens * tokens, self.q_steps + 1
        )
        # chunk_seconds(0, tokens), the one chunk's step
        chunk = max(STEP_MIN, here + self.memo_stall * tokens)
        return ttft, chance_above(math.log(chunk) - self.log_itl_bound, STEP_SPREAD)

    def holds(self, tokens: int) -> float:
        """How much longer prefilling ``tokens`` uncached tokens here makes the calls behind it
        wait: its tokens' compute, and a step for each chunk past its first (a prompt within
        one chunk shares its step with the calls that join it, a step the decodes run anyway)."""
        p = self.prefill
        return p.b * tokens + p.q * tokens * tokens + p.c * (self.steps_of(tokens) - 1)

    def queue_seconds(self) -> float:
        """What the prompts queued here add to the first token of a request that arrives now
        (a decode leg's, whose own prefill happened elsewhere)."""
        p = self.prefill
        return p.b * self.q_tokens + p.q * self.q_sq + p.c * self.q_steps

    def step_seconds(self, streams: int) -> float:
        """A decode step with ``streams`` streams, as the other engines' work makes it now
        (``StepFit.__call__`` at ``CostModel.others_busy``, inlined: a decision asks it a
        dozen times)."""
        m, st = self.model, self.step
        busy = (m.busy - (1 if self.jobs else 0)) * m.others_scale
        return max(STEP_MIN, (st.s0 + st.s1 * streams) * (1.0 + st.crowding * busy))

    def step_here(self) -> float:
        """A decode step with the streams decoding here now: :meth:`step_seconds` at
        ``decoding``, kept for the instant (:meth:`_remember`)."""
        if self.memo_tick != self.model.tick:
            self._remember()
        return self.memo_step

    def step_next(self) -> float:
        """A decode step with one stream more than decode here now."""
        if self.memo_tick != self.model.tick:
            self._remember()
        return self.memo_step_next

    def _remember(self) -> None:
        """Work out the figures a decision asks of this engine a dozen times (its step now and
        with one more stream, the stall per prompt token), kept until ``CostModel.tick``
        moves: every change to any engine's state moves it, and so does each decision (the
        tests change a fit by hand between them). The slow-gap share is kept per instant too
        (:meth:`slow_share`). Asked afresh each time, they were a sixth of the decision's CPU
        (``pd_router_dev.goodput_cost``, 2026-12-07)."""
        self.memo_tick = self.model.tick
        self.memo_step = self.step_seconds(self.decoding)
        self.memo_step_next = self.step_seconds(self.decoding + 1)
        x0 = STALL_PRIOR * 256.0 * 256.0
        self.memo_stall = (self.stall_xy + x0 * self.prefill.b) / (self.stall_xx + x0)
        self.memo_share_at = math.nan

    def busy_left(self) -> float:
        """Seconds until the calls here now should be over: the longest of each stream's tokens
        left at the step now, behind the prompts queued for those not yet prefilled."""
        if not self.jobs:
            return 0.0
        step = self.step_here()
        queue = self.queue_seconds()
        left = 0.0
        for j in self.jobs:
            t = max(0, j.out - j.gaps) * step + (0.0 if j.prefilled else queue)
            left = max(left, t)
        return left

    def stall_per_token(self) -> float:
        """What a prompt token adds to the step that prefills it, as the streams here saw it
        (the prefill fit's ``k`` until they did)."""
        if self.memo_tick != self.model.tick:
            self._remember()
        return self.memo_stall

    def chunk_seconds(self, done: float, c: float) -> float:
        """A step that carries ``c`` prompt tokens of a prompt ``done`` tokens in: the decode
        step and that chunk's compute (the stall seen per token, with attention's growth over
        the tokens before it from the prefill fit)."""
        return max(
            STEP_MIN, self.step_here() + self.stall_per_token() * c + self.prefill.q * 2 * done * c
        )

    def _stall(self, tokens: int, gap: float) -> None:
        """A gap that ended with the step that prefilled ``tokens`` (its last chunk)."""
        y = gap - self.step_seconds(self.decoding)
        if y > 0 and tokens > 0:
            d = FORGET
            self.stall_xy = self.stall_xy * d + tokens * y
            self.stall_xx = self.stall_xx * d + tokens * tokens
            self.model.tick += 1

    def saw_first_token(self, tokens: int, now: float) -> None:
        """A prompt of ``tokens`` uncached tokens was prefilled here just now (its first
        token): the gap of a stream that ended with the same step teaches the stall."""
        last = min(float(tokens), self.chunk)
        t, g = self.last_gap
        if t and now - t < STEP_MATCH * self.step_seconds(self.decoding):
            self._stall(int(last), g)
        self.last_prefill = (now, int(last))

    def saw_gap(self, dt: float, now: float) -> None:
        t, n = self.last_prefill
        if t and now - t < STEP_MATCH * self.step_seconds(self.decoding):
            self._stall(n, dt)
            self.last_prefill = (0.0, 0)  # one sample a step
        self.last_gap = (now, dt)

    def slow_steps(self, tokens: int) -> float:
        """The steps past the ITL bound that prefilling ``tokens`` here is expected to cause
        its decoding streams: each chunk of the prompt (vLLM's budget a step) is past the bound
        with the chance a prediction that far from it is wrong (``STEP_SPREAD``): a prompt
        whose chunks all fit well within the bound stretches nothing, one near it a fraction
        of a step."""
        bound = self.log_itl_bound
        size = self.chunk_size
        if tokens <= 0:
            return 0.0
        if tokens <= size:  # one chunk (most prompts): its step alone
            return chance_above(math.log(self.chunk_seconds(0.0, tokens)) - bound, STEP_SPREAD)
        total, done, n, t = 0.0, 0.0, 0, self.itl_bound
        while done < tokens and n < MAX_CHUNKS:
            c = min(size, tokens - done)
            t = self.chunk_seconds(done, c)
            total += chance_above(math.log(t) - bound, STEP_SPREAD)
            done += c
            n += 1
        if done < tokens:  # the rest at the last chunk's rate
            total += (tokens - done) / size * chance_above(math.log(t) - bound, STEP_SPREAD)
        return total

    def slow_share(self, now: float) -> float:
        """The share of this engine's gaps to expect past the ITL bound: what its streams saw
        over the window (a machine, a batch or prefills that stretch its steps, all alike),
        held towards what the prefills placed here predict until ``SEEN_PRIOR`` gaps were
        seen."""
        if self.memo_tick != self.model.tick:
            self._remember()
        if self.memo_share_at != now:
            model = min(1.0, self.stretch(now) * self.memo_step)
            self.memo_share = (self.slow_d + SEEN_PRIOR * model) / (self.gaps_d + SEEN_PRIOR)
            self.memo_share_at = now
        return self.memo_share

    def harm(self, slow_steps: float, now: float) -> float:
        """The expected number of streams decoding here that ``slow_steps`` more stretched
        steps push past their ITL p95: for each, the chance that the stretched gaps still to
        come (those of the prefills queued ahead, then this engine's share of slow gaps over
        what it has left to decode) exceed its budget left, with these steps less without
        them. A stream already past its budget is not counted again; one with budget to spare
        costs a little, so prefills drift to where few streams decode."""
        if slow_steps <= HARM_NEGLIGIBLE:
            return 0.0
        # a fraction of a step: that chance of one more (whole steps and a part)
        whole = math.floor(slow_steps)
        part = slow_steps - whole
        ahead = self.queued_slow
        share = self.slow_share(now)
        total = 0.0
        for j in self.jobs:
            if not j.decoding or j.gaps >= j.out:
                continue
            left = math.floor(j.slow_budget - j.slow - ahead)
            if left < 0:
                continue
            future = share * (j.out - j.gaps)
            now_miss = poisson_above(future, left)
            more = poisson_above(future, left - whole) - now_miss
            if part:
                more += part * (poisson_above(future, left - whole - 1) - now_miss - more)
            total += more
        return total

    def stretch(self, now: float) -> float:
        """Stretched gaps to expect per decode step a stream spends here, by the prefills
        placed here: their slow-step rate over the time a token takes, which the stretched
        steps lengthen in turn (an engine prefilling a share ``r x gap`` of its time decodes
        ``1 - r x gap`` of it)."""
        rate = self.slow.value(now)
        if rate <= 0:
            return 0.0
        gap = self.slow_gap or self.chunk_seconds(0.0, self.chunk)
        return rate / max(0.1, 1.0 - rate * gap)

    # ------------------------------------------------------------------ bookkeeping
    def start(
        self,
        kind: str,
        tokens: int,
        out: int,
        stream: bool,
        now: float,
        planned: tuple[float, float] | None = None,
        slack: float | None = None,
    ) -> Job:
        """``planned``: (slow steps, prefill seconds) the decision predicted for this very call
        (a prefill's are the same figures, found again otherwise). ``slack``: the TTFT slack
        of the request the call is part of, as its decision predicted it, retries included (None:
        not counted as an arrival)."""
        if slack is not None:
            self.arrived(slack, now)
        if kind == "decode":
            slow = 0.0
        elif planned is not None:
            slow = planned[0]
        else:
            slow = self.slow_steps(tokens)
        job = Job(self, kind, tokens, out, stream, slow, now)
        job.ahead = (self.q_tokens, self.q_sq, self.q_steps)
        job.step0 = self.step_seconds(self.decoding)
        if kind == "decode":
            job.decoding = True  # its first step only loads what was pulled
            self.decoding += 1
        else:
            if kind == "whole" and not stream:
                pf = planned[1] if planned is not None else self.prefill_seconds(tokens)
                job.t_due = now + pf
                self.unseen[job] = None
                self.next_due = min(self.next_due, job.t_due)
            self.q_tokens += tokens
            self.q_sq += tokens * tokens
            self.q_steps += job.steps
            self.queued_slow += slow
            if slow:
                self.slow.add(slow, now)
        if not self.jobs:
            self.model.busy += 1
        self.jobs.add(job)
        self.model.tick += 1
        return job

    def _prefilled(self, job: Job, now: float, learn: bool) -> None:
        """``job``'s prompt is prefilled: out of the queue; ``learn``: its time teaches the
        prefill fit (the queue it waited behind and its own prompt)."""
        if job.prefilled:
            return
        job.prefilled = True
        self.q_tokens -= job.tokens
        self.q_sq -= job.tokens * job.tokens
        self.q_steps -= job.steps
        self.queued_slow -= job.slow_steps
        if learn:
            self.learn_prefill(job, now)

    def learn_prefill(self, job: Job, now: float) -> None:
        x, x2, steps = job.ahead
        n = job.tokens
        y = now - job.t_send - job.step0
        self.prefill.add(x + n, x2 + n * n, steps + job.steps, y, False)
        self.model.prefill.add(x + n, x2 + n * n, steps + job.steps, y, False)
        self.refresh_prefill(now)

    def first_token(self, job: Job, now: float) -> None:
        if job.kind == "whole":
            self.saw_first_token(job.tokens, now)
            self._prefilled(job, now, True)
            job.decoding = True
            self.decoding += 1
            self.model.tick += 1
        elif job.kind == "decode":
            # the pull and its first step, less the prompts queued ahead of it here
            x, x2, steps = job.ahead
            p = self.prefill
            waited = now - job.t_send - (p.b * x + p.q * x2 + p.c * steps)
            self.model.handoff.add(job.tokens, waited)

    def ended(self, job: Job, now: float) -> None:
        if job in self.jobs:
            self.jobs.discard(job)
            if not self.jobs:
                self.model.busy -= 1
        self.unseen.pop(job, None)
        # out of the queue; what it teaches is told apart (Job.first, Job.answered): a call
        # that failed teaches nothing
        self._prefilled(job, now, False)
        if job.decoding:
            self.decoding -= 1
        if job.usual > 0:
            self._learn_step(
                job.streams_sum / job.usual, job.busy_sum / job.usual, job.gap_sum / job.usual
            )
        if job.slow:
            mean = job.slow_gap_sum / job.slow
            self.slow_gap = mean if not self.slow_gap else 0.8 * self.slow_gap + 0.2 * mean
        self.model.tick += 1

    def _learn_step(self, streams: float, busy: float, gap: float) -> None:
        """A call's streams saw a mean gap of ``gap`` with ``streams`` streams decoding here and
        a share ``busy`` of the other engines at work."""
        now = self.clock()
        solve = now - self.step_solved_at >= SOLVE_SECONDS
        self.step.add(streams, busy, gap, solve)
        if solve:
            self._step_solved(now)
        self.model.tick += 1

    def _step_solved(self, now: float) -> None:
        self.step_solved_at = now
        m = self.model
        if (self.step.crowding >= CROWD_MIN) != m.crowded:
            m.crowded = any(e.step.crowding >= CROWD_MIN for e in m.engines)
        if (self.step.crowding >= CROWD_CONSOLIDATE) != m.consolidate:
            m.consolidate = any(e.step.crowding >= CROWD_CONSOLIDATE for e in m.engines)


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


def chance_above(z: float, spread: float = STEP_SPREAD) -> float:
    """The chance that a log-normal quantity predicted ``z`` (log units) from a bound is past
    it."""
    return 0.5 * (1.0 + math.erf(z / (spread * _SQRT2)))


_SQRT2 = math.sqrt(2.0)


class CostModel:
    """The fits and loads of every engine this router process sends to, and the pooled
    hand-off fit (see the module docstring)."""

    def __init__(
        self,
        cfg: Goodput,
        clock: Clock = time.perf_counter,
        report: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        seed = cfg.seed
        h = seed.handoff_seconds or PRIOR_HANDOFF
        self.handoff = Fit(h, PRIOR_HANDOFF_PER_TOKEN, 4096.0)
        # every engine's prefill samples: the prior of each engine's per-token costs
        # (PrefillFit.lean_on)
        self.prefill = seeded_prefill(cfg)
        self.prefill_solved_at = -math.inf
        base = max(1e-3, cfg.ttft_seconds) / 4
        self.slack_of = [base * 2.0**i for i in range(SLACK_BUCKETS)]  # each bucket's slack
        self._engines: dict[tuple[str, int], EngineCosts] = {}
        self.busy = 0  # engines with a call of this router in flight
        # moved by every change to an engine's state and by each decision: an engine's figures
        # for the state as it is are kept while it stays (EngineCosts._remember)
        self.tick = 0
        self.others_scale = 1.0  # 1 / the other engines an engine has
        self.crowded = cfg.seed.crowding >= CROWD_MIN  # an engine's crowding is, now
        self.consolidate = cfg.seed.crowding >= CROWD_CONSOLIDATE  # and as much as that
        # (engine, quantity, value): what the model believes, for pd_router_engine_cost, at most
        # once a second per engine (EngineCosts.refresh)
        self.report = report
        # UTF-8 bytes per token of the prompts counted exactly: sizes the prompts that are not
        # (pd_router.decide, a short prompt weighed at its upper bound)
        self.bytes_per_token = float(BYTES_PER_TOKEN)

    def slack_bucket(self, slack: float) -> int:
        """The bucket of a TTFT slack of ``slack`` seconds (:attr:`slack_of` each bucket's)."""
        if slack <= self.slack_of[0]:
            return 0
        i = round(math.log2(slack / self.slack_of[0]))
        return min(SLACK_BUCKETS - 1, i)

    def pooled_prefill(self, now: float) -> PrefillFit | None:
        """The pooled prefill fit, solved at most every ``SOLVE_SECONDS``; None before its
        first sample."""
        p = self.prefill
        if not p.n:
            return None
        if p.pending and now - self.prefill_solved_at >= SOLVE_SECONDS:
            p.solve()
            self.prefill_solved_at = now
        return p

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
            c = self._engines[key] = EngineCosts(self, base)
            for k in [k for k in self._engines if k[0] == base and k[1] < generation]:
                del self._engines[k]
            self.others_scale = 1.0 / max(1, len(self._engines) - 1)
            self.tick += 1
        return c

    @property
    def engines(self) -> list[EngineCosts]:
        return list(self._engines.values())

    def others_busy(self, c: EngineCosts) -> float:
        """The share of the engines other than ``c`` with a call in flight."""
        return (self.busy - (1 if c.jobs else 0)) * self.others_scale

    def ttft_bound(self, prompt_tokens: int) -> float:
        g = self.cfg
        return g.ttft_seconds + g.ttft_seconds_per_kilo_token * prompt_tokens / 1000.0


class Meter:
    """One request's tie to the cost model: each engine call of it starts a :class:`Job`
    sized by what the decision learnt (the prompt's tokens, those each engine holds, the output
    budget); a call to an engine the decision did not weigh (a retry) counts the whole prompt.
    The call the decision planned starts from its predictions (``planned``: the engine that
    prefills, the call's kind, its slow steps and prefill seconds)."""

    __slots__ = ("held", "model", "out", "planned", "slack", "stream", "tokens")

    def __init__(
        self,
        model: CostModel,
        tokens: int,
        held: dict[str, int],
        out: int,
        stream: bool,
        planned: tuple[str, str, float, float] | None = None,
        slack: float | None = None,
    ) -> None:
        self.model = model
        self.slack = slack  # the request's TTFT bound less its predicted TTFT
        self.tokens = tokens
        self.held = held  # engine base URL -> prompt tokens it holds
        self.out = out
        self.stream = stream
        self.planned = planned

    def job(self, base: str, generation: int, kind: str) -> Job:
        """A call of ``kind`` to that engine, sent now (its Lease ends it)."""
        tokens = max(1, self.tokens - self.held.get(base, 0))
        c = self.model.of(base, generation)
        p = self.planned
        figures = (p[2], p[3]) if p is not None and p[0] == base and p[1] == kind else None
        out = self.out if kind != "prefill" else 0
        return c.start(kind, tokens, out, self.stream, c.clock(), figures, self.slack)
