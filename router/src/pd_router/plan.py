"""The goodput decision (``routing.decision: goodput``): for each request, among serving it
whole on one engine or prefilling it on one and decoding it on another, the option that keeps
the most requests within their SLOs (``routing.goodput``), predicted from what each engine
costs and carries (pd_router.costs).

For every option the router predicts:

- the request's **TTFT**: whole on Y, Y's prefill fit over what Y has queued plus the tokens Y
  does not hold; split X -> Y, X's prefill the same way, then the hand-off (the pull of what Y
  does not hold and Y's first step) behind what Y has queued;
- its **ITL p95**: the decoding engine's step time with one more stream, and how many of its
  gaps will pass the ITL bound while it decodes (the share of that engine's gaps its streams
  saw past the bound over the window, whatever stretched them, times the request's tokens);
- the **harm** it does: the streams decoding on the engine that prefills it which this
  prefill's stretched steps push past their ITL p95 (each stream's slow-gap budget is 5 % of
  its output tokens, less the slow gaps it has seen and those the prefills queued ahead will
  cause), and, where engines crowd each other (pd_router.costs.StepFit), the streams on the
  other engines that its keeping an engine at work longer than that engine's calls would
  slows past their ITL p95 (:meth:`Planner.crowding`), and the arrivals its prefill holds up:
  the calls placed on the engine that prefills it while that prefill runs, each waiting for it
  (vLLM serves its waiting queue in order) and so pushed past its TTFT bound where the wait is
  longer than the slack it was placed with (:meth:`Planner.held_up`).

It then counts the **expected SLO misses** of each option: the chance that its TTFT passes its
bound (the prediction taken as log-normally spread, ``TTFT_SPREAD``), the chance that more of
its gaps than its budget pass the ITL bound (Poisson at the expected count), 1 when its step
alone passes it, the streams it harms, and the arrivals it holds up.

**The rule**: a split must risk ``TIE`` fewer expected misses than the best whole option (a
hand-off must earn its risk); among the rest, the fewest expected misses, then the earliest
first token, except that, where engines crowd each other (pd_router.costs.StepFit: engines that
share a machine's cores or memory bandwidth), options risking almost nothing (``PACK``) go to
the decoder with the most streams already: an engine with nothing to do is left with nothing to
do, and the others keep their speed. On engines that do not crowd each other (GPUs of their own)
that would only queue short prompts behind each other: there, the earliest first token. And
where engines crowd each other as much as ``CROWD_CONSOLIDATE`` (pd_router.costs: one at work at
least doubles the others' steps), a prompt of one chunk (vLLM's ``max_num_batched_tokens``) is
first weighed for the engines at work alone and served whole on the one that risks the fewest
expected misses (within ``TIE``, the one with the most streams) while that risks at most
``WAKE`` (``one_engine_enough``). Not a longer one: its chunks' steps hold the prompts that
arrive behind it (kept there too, mixed traffic at 0.9 of capacity missed 28 first tokens of
141 against the fixed split's 19, 0.77 x its goodput, on the real engines on 2026-12-06), and
a prompt of one chunk that takes seconds is kept only while the arrivals it holds up leave it
within ``WAKE``. On this project's CPU engines two engines at work each decode
2.6-4.7 x slower than one alone, so one engine serves more within the SLOs than two, and the
per-request weighing, which prices an option from the state it finds, cannot see that: once the
other engine is at work for the requests before, every option is weighed crowded. Splits are
weighed only when the best whole option risks more than ``TIE`` (``handoff_not_worth``
otherwise, decided after weighing each engine once). Because a request decoding on an engine
whose gaps are often stretched risks its ITL, streams drift to the engines that prefill least,
and prefills to the engines whose streams they harm least: the engines settle into prefill and
decode roles as the traffic asks, and back again when it changes, without a pod changing.

Reasons (``x-pd-reason``, pd_router.metrics.DECIDED): ``handoff_not_worth`` (whole; its risk is
within ``TIE``, so no split could do better), ``one_engine_enough`` (whole on an engine at
work, where engines crowd each other: within ``WAKE``), ``whole_best`` (whole;
splits were weighed and lost), ``split_protects_itl`` (split; a whole option risks more ITL
misses, this request's or other streams'), ``split_faster`` (split; a whole option risks more
TTFT misses, its own or those of the arrivals its prefill holds up). The predicted figures go
back in ``x-pd-predicted`` and in the trace, and the router exports observed / predicted TTFT
(``pd_router_ttft_prediction_ratio``) so that a user sees the model's error.

Pairs keep the revision rule (pd_router.revision): both engines serve the same KV revision, and
the same weights of it (pd_router.weights: ``Endpoint.pairing``).
An engine is never sent its own prefill's ``kv_transfer_params`` (vLLM 0.31/0.33 do not guard a
handshake with themselves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd_router.costs import (
    CROWD_MIN,
    DEFAULT_OUTPUT_TOKENS,
    CostModel,
    EngineCosts,
    chance_above,
)
from pd_router.discovery import Endpoint
from pd_router.pairs import HandoffPairs

# Spread of a TTFT prediction (the standard deviation of log(observed / predicted)) used to
# turn it into the chance of missing the bound: the cost model aims at 25 % p50 error.
TTFT_SPREAD = 0.3
# A split must risk this many fewer expected misses than serving whole to be taken.
TIE = 0.05
# Where engines crowd each other, options that risk at most this many expected misses are
# packed onto the busier decoder.
PACK = 0.01
# Where engines crowd each other as much as pd_router.costs.CROWD_CONSOLIDATE, a request goes
# whole to the engine with the most streams while that risks at most this many expected misses;
# only beyond it are the others weighed (:meth:`Planner.choose`). High because that risk is
# weighed in the state the other engines' work left that engine in (crowded steps, the slow gaps
# its streams saw), not in the state that serving there would keep it in: in one short-prompt
# run at 0.9 of capacity the option was predicted at 1.11 expected misses and missed 0.68
# (observed); at 0.5 the cell's goodput was 0.37 x the fixed split's, at 2.0 0.99 x
# (docs/benchmarks.md, 2026-12-06).
WAKE = 2.0

# A prefill shorter than this share of the arrivals' TTFT slack holds none of them past their
# bound that counts (ttft_miss at 0.3 x its bound is 3e-5): not weighed.
HELD_NEGLIGIBLE = 0.3

# How many prefillers and decoders (best first by their own side's score) are paired up: the
# pairs beyond them cannot win on a pool of alike engines, and 4 x 4 keeps the decision cheap
# on large pools.
PAIR_CANDIDATES = 4

Held = Callable[[Endpoint], int]


@dataclass(slots=True)  # not frozen: a frozen init costs a microsecond a request
class Option:
    """One way to serve the request and what it is predicted to do (not changed once made)."""

    decoder: Endpoint
    prefiller: Endpoint | None  # None: whole on ``decoder``
    ttft: float  # seconds from now to its first token
    itl: float  # its typical inter-token gap (the decoding engine's step), seconds
    misses: float  # expected SLO misses: its TTFT, its ITL, and the streams its prefill harms
    itl_misses: float  # of which from ITL (its own and the harmed streams')
    streams: int = 0  # streams decoding on its decoder now
    slow: float = 0.0  # steps its prefill is expected to stretch where it is prefilled
    prefill: float = 0.0  # seconds its prefill is predicted to take there (queue included)
    harm: float = 0.0  # of ``itl_misses``, the streams its prefill pushes past their ITL p95
    held_up: float = 0.0  # of ``misses``, the arrivals its prefill holds past their TTFT bound

    def planned(self) -> tuple[str, str, float, float]:
        """What the call that prefills it starts from (pd_router.costs.Meter): that engine,
        the call's kind, its slow steps and prefill seconds."""
        if self.prefiller is None:
            return (self.decoder.base, "whole", self.slow, self.prefill)
        return (self.prefiller.base, "prefill", self.slow, self.prefill)

    def better(self, other: Option, pack: float) -> bool:
        """The rule (module docstring): fewer expected misses (by more than ``TIE``); then
        whole; then, when both risk at most ``pack`` (``PACK`` where engines crowd each other,
        else below zero), the decoder with more streams already; then fewer expected misses;
        then the earlier first token."""
        if abs(self.misses - other.misses) > TIE:
            return self.misses < other.misses
        if (self.prefiller is None) != (other.prefiller is None):
            return self.prefiller is None
        if self.misses <= pack and other.misses <= pack and self.streams != other.streams:
            return self.streams > other.streams
        if self.misses != other.misses:
            return self.misses < other.misses
        return self.ttft < other.ttft

    def header(self) -> str:
        """``x-pd-predicted``: what the decision expected of the option it took."""
        return (
            f"ttft_ms={self.ttft * 1000:.1f}; itl_ms={self.itl * 1000:.1f}; "
            f"misses={self.misses:.2f}; held_up={self.held_up:.2f}"
        )


@dataclass(frozen=True, slots=True)
class Choice:
    option: Option
    reason: str


class Planner:
    """Weighs the options of one request (see the module docstring)."""

    def __init__(self, model: CostModel, pairs: HandoffPairs | None = None) -> None:
        self.model = model
        self.pairs = pairs  # pairs quarantined for failed hand-offs are not options
        self.itl_bound = model.cfg.itl_seconds

    def _costs(self, ep: Endpoint, now: float) -> EngineCosts:
        c = self.model.of(ep.base, ep.generation)
        c.refresh(now)
        return c

    def crowding(self, c: EngineCosts, seconds: float, now: float) -> float:
        """The streams decoding on the other engines that ``c`` pushes past their ITL p95 by
        working ``seconds`` from now: all that while their steps are as slow as ``c`` at work
        makes them (StepFit.crowding), each the more likely past the bound. Where engines
        crowd each other as much as ``CROWD_CONSOLIDATE``, each call is charged for the whole
        of its time, whatever else keeps ``c`` at work: charged only for the time it added to
        the calls ``c`` had (EngineCosts.busy_left), a split found the prefiller kept at work
        by the splits before it and looked free, and short prompts went on being split on a
        machine where one engine alone served them better. Below that, the time it adds: an
        engine about to fall idle is dearer to send to than one that works on anyway (charged
        whole there, on the simulated H100s' few tenths of crowding learnt from noise, short
        prompts at 0.9 of capacity fell from 0.97 to 0.88 x the best static choice)."""
        m = self.model
        if not m.crowded:
            return 0.0
        extra = seconds if m.consolidate else seconds - c.busy_left()
        if extra <= 0:
            return 0.0
        bound = math.log(self.itl_bound)
        c_busy = m.others_scale if c.jobs else 0.0
        total = 0.0
        for e in m.engines:
            if e is c or not e.decoding or e.step.crowding < CROWD_MIN:
                continue
            e.refresh(now)
            idle = m.others_busy(e) - c_busy  # the share of e's others at work, c idle
            before = e.step(e.decoding, idle)
            after = e.step(e.decoding, min(1.0, idle + m.others_scale))
            more = chance_above(math.log(after) - bound) - chance_above(math.log(before) - bound)
            if more > 0.001:
                total += e.harm(extra / after * more, now)
        return total

    def held_up(self, c: EngineCosts, tokens: int, now: float) -> float:
        """The arrivals that prefilling ``tokens`` uncached prompt tokens on ``c`` pushes past
        their TTFT bound. vLLM's scheduler serves its waiting queue in order and a prompt's
        chunk fills a step's token budget, so each call placed on ``c`` before that prefill
        ends (behind the prompts queued ahead) waits longer by what it adds
        (pd_router.costs.EngineCosts.holds). Per bucket of TTFT slack
        (pd_router.costs.EngineCosts.arrived): the calls of that slack the decisions placed
        there per second over the window, through that time less the slack, each missing with
        the chance that what the prefill adds passes its slack (log-normal, ``TTFT_SPREAD``).
        By buckets, not a mean slack: the decode legs of long prompts, seconds of slack each,
        would hide the short prompts' tenths. Without the charge, a long prompt served whole
        on the engine that takes the short ones (the one-engine rule) kept them waiting
        seconds behind its chunks: mixed traffic at 0.9 of capacity missed 64 short first
        tokens of 100 against the fixed split's 2 (run AA, docs/benchmarks.md)."""
        if not c.arrival_t:
            return 0.0
        own = c.holds(tokens)
        slack_of = self.model.slack_of
        queue = -1.0
        total = 0.0
        for i, w in enumerate(c.arrivals):
            if not w:
                continue
            slack = slack_of[i]
            if own <= HELD_NEGLIGIBLE * slack:  # nor any bucket after it: most prompts
                break
            if queue < 0:
                queue = c.queue_seconds()
            span = queue + own - slack
            if span <= 0.0:
                break
            total += w * span * ttft_miss(own, slack)
        if not total:
            return 0.0
        return total * math.exp(-(now - c.arrival_t) / c.tau)

    def whole(self, ep: Endpoint, tokens: int, out: int, bound: float, now: float) -> Option:
        c = self._costs(ep, now)
        ttft, slow = c.prefill_figures(tokens)
        step, itl_miss = c.decode_miss(out, now)
        harm = c.harm(slow, now)
        itl_misses = itl_miss + harm + self.crowding(c, ttft + out * step, now)
        up = self.held_up(c, tokens, now)
        misses = ttft_miss(ttft, bound) + itl_misses + up
        return Option(ep, None, ttft, step, misses, itl_misses, c.decoding, slow, ttft, harm, up)

    def retimed(self, o: Option, tokens: int, bound: float, now: float) -> Option:
        """The whole option ``o``, weighed at a prompt's upper bound, for the ``tokens`` it is
        estimated at: its TTFT, its prefill's slow steps and their harm found again; its own
        ITL kept (the engine's step and slow gaps do not depend on the prompt). Asked right
        after :meth:`choose` weighed ``o``, with nothing changed since: the engine's figures
        kept then still hold (``CostModel.tick``)."""
        c = self._costs(o.decoder, now)
        ttft, slow = c.prefill_figures(tokens)
        harm = c.harm(slow, now)
        itl_misses = o.itl_misses - o.harm + harm
        up = self.held_up(c, tokens, now)
        misses = ttft_miss(ttft, bound) + itl_misses + up
        return Option(
            o.decoder, None, ttft, o.itl, misses, itl_misses, o.streams, slow, ttft, harm, up
        )

    def choose(
        self,
        prompt: int,
        held: Held,
        decoders: Sequence[Endpoint],
        prefillers: Sequence[Endpoint],
        out: int | None,
        now: float,
    ) -> Choice | None:
        """The option to take for a prompt of ``prompt`` tokens (``held(ep)``: how many of
        them ``ep`` holds already) with ``out`` output tokens at most; None without decoders."""
        self.model.tick += 1  # each engine's figures worked out afresh for this decision
        if not decoders:
            return None
        out = out if out and out > 0 else DEFAULT_OUTPUT_TOKENS
        bound = self.model.ttft_bound(prompt)
        if self.model.crowded:
            weighed: dict[str, Option] = {}
            if self.model.consolidate and decoders[1:]:
                kept = self._one_engine(prompt, held, decoders, out, bound, now, weighed)
                if kept is not None and kept.misses <= WAKE:
                    return Choice(kept, "one_engine_enough")
            return self._choose(prompt, held, decoders, prefillers, out, bound, now, PACK, weighed)
        return self._choose(prompt, held, decoders, prefillers, out, bound, now, -1.0)

    def _one_engine(
        self,
        prompt: int,
        held: Held,
        decoders: Sequence[Endpoint],
        out: int,
        bound: float,
        now: float,
        weighed: dict[str, Option],
    ) -> Option | None:
        """The one-engine rule's candidate: the prompt whole on an engine already at work, the
        one that risks the fewest expected misses, or, within ``TIE`` of that, the one with
        the most streams; None where no engine is at work or the prompt is longer than a
        chunk. Not simply the engine with the most streams: engines are not alike (on this
        project's CPU machines core 0's decodes about twice as slowly), and kept on the
        slower one, short prompts at 0.9 of capacity were served at 0.57 x the fixed split,
        whose one decoder was the faster (2026-12-06). Each option weighed goes in ``weighed``
        (by engine), for :meth:`_choose` to take rather than weigh again."""
        kept: Option | None = None
        for ep in decoders:
            c = self._costs(ep, now)
            tokens = max(1, prompt - held(ep))
            if not c.decoding or c.steps_of(tokens) != 1:
                continue
            o = weighed[ep.base] = self.whole(ep, tokens, out, bound, now)
            if kept is None or _kept_rather(o, kept):
                kept = o
        return kept

    def _choose(
        self,
        prompt: int,
        held: Held,
        decoders: Sequence[Endpoint],
        prefillers: Sequence[Endpoint],
        out: int,
        bound: float,
        now: float,
        pack: float,
        weighed: dict[str, Option] | None = None,
    ) -> Choice:
        best: Option | None = None
        for ep in decoders:
            o = weighed.get(ep.base) if weighed else None
            if o is None:
                o = self.whole(ep, max(1, prompt - held(ep)), out, bound, now)
            if best is None or o.better(best, pack):
                best = o
        assert best is not None
        if not prefillers or (len(decoders) == 1 and all(p is decoders[0] for p in prefillers)):
            return Choice(best, "handoff_not_worth")  # no engine to pair with another
        # a split wins only by more than TIE fewer expected misses: none can when the best
        # whole option risks no more than that
        if best.misses <= TIE:
            return Choice(best, "handoff_not_worth")
        split = self._best_split(prompt, held, decoders, prefillers, out, bound, now, pack)
        if split is None or not split.better(best, pack):
            return Choice(best, "whole_best")
        if best.itl_misses - split.itl_misses > TIE:
            return Choice(split, "split_protects_itl")
        return Choice(split, "split_faster")

    def _best_split(
        self,
        prompt: int,
        held: Held,
        decoders: Sequence[Endpoint],
        prefillers: Sequence[Endpoint],
        out: int,
        bound: float,
        now: float,
        pack: float,
    ) -> Option | None:
        # each side scored on its own: the prefiller by (streams it harms, its TTFT part), the
        # decoder by (its ITL miss, the wait behind its queue); the best few of each paired
        pre = []
        for x in prefillers:
            if x.pairing is None:
                continue
            c = self._costs(x, now)
            tokens = max(1, prompt - held(x))
            slow = c.slow_steps(tokens)
            pf = c.prefill_seconds(tokens)
            up = self.held_up(c, tokens, now)
            harm = c.harm(slow, now) + self.crowding(c, pf, now)
            pre.append((harm + up, pf, x, slow, harm, up))
        pre.sort(key=lambda t: (t[0], t[1]))
        dec = []
        for y in decoders:
            if y.pairing is None:
                continue
            c = self._costs(y, now)
            pull = max(1, prompt - held(y))
            step, itl_miss = c.decode_miss(out, now)
            wait = self.model.handoff(pull) + c.queue_seconds()
            itl_miss += self.crowding(c, wait + out * step, now)
            dec.append((itl_miss, wait, step, y, c.decoding))
        dec.sort(key=lambda t: (t[0], t[1]))
        best: Option | None = None
        pairs = self.pairs if self.pairs is not None and self.pairs.any_out else None
        # (with pairs out, every engine: the best few might be only pairs that are out)
        n = len(pre) + len(dec) if pairs is not None else PAIR_CANDIDATES
        for _, pf, x, slow, harm, up in pre[:n]:
            for itl_miss, wait, step, y, streams in dec[:n]:
                if y is x or y.pairing != x.pairing:
                    continue
                if pairs is not None and not pairs.usable(x, y):
                    continue
                ttft = pf + wait
                itl_misses = harm + itl_miss
                misses = ttft_miss(ttft, bound) + itl_misses + up
                o = Option(y, x, ttft, step, misses, itl_misses, streams, slow, pf, harm, up)
                if best is None or o.better(best, pack):
                    best = o
        return best


def _kept_rather(o: Option, kept: Option) -> bool:
    """The one-engine rule's order: fewer expected misses by more than ``TIE``; within it, more
    streams (alike engines keep the work where it is)."""
    if o.misses < kept.misses - TIE:
        return True
    return o.misses <= kept.misses + TIE and o.streams > kept.streams


def ttft_miss(predicted: float, bound: float) -> float:
    """The chance that a first token predicted at ``predicted`` seconds comes after ``bound``
    (log-normal spread ``TTFT_SPREAD`` around the prediction)."""
    if predicted <= 0:
        return 0.0
    return 0.5 * (1.0 + math.erf(math.log(predicted / bound) * _TTFT_Z))


_TTFT_Z = 1.0 / (TTFT_SPREAD * math.sqrt(2.0))
