"""The goodput decision without I/O (pd_router.plan over pd_router.costs): each option it can
take, each beside a negative control that changes the one thing the option depends on; the
cost model's fits and load bookkeeping; the pairing rules (one revision, never an engine with
itself)."""

from __future__ import annotations

import math
import random

import pytest

from pd_router.config import Goodput, GoodputSeed, Health
from pd_router.costs import (
    CROWD_CONSOLIDATE,
    PRIOR_CHUNK_TOKENS,
    REBASE_TAUS,
    SLACK_BUCKETS,
    SOLVE_SECONDS,
    CostModel,
    EngineCosts,
    Fit,
    Meter,
    PrefillFit,
    _solve,
    poisson_above,
)
from pd_router.discovery import Endpoint
from pd_router.pairs import HandoffPairs
from pd_router.plan import WAKE, Planner, ttft_miss

# A 1 ms/token prefill, 10 ms decode steps, a 20 ms hand-off: an engine of round numbers.
SEED = GoodputSeed(prefill_tokens_per_second=1000.0, decode_step_seconds=0.01, handoff_seconds=0.02)
SLO = Goodput(ttft_seconds=0.5, ttft_seconds_per_kilo_token=1.5, itl_seconds=0.05, seed=SEED)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def engines(*names: str, revision: str | None = "r1") -> list[Endpoint]:
    out = []
    for n in names:
        ep = Endpoint(f"http://{n}:8000")
        ep.revision = revision
        ep.generation = 1
        out.append(ep)
    return out


def setup(cfg: Goodput = SLO) -> tuple[CostModel, Planner, Clock]:
    clock = Clock()
    model = CostModel(cfg, clock)
    return model, Planner(model), clock


def costs(model: CostModel, ep: Endpoint) -> EngineCosts:
    return model.of(ep.base, ep.generation)


def decoding(
    model: CostModel,
    ep: Endpoint,
    streams: int,
    out: int = 100,
    slow_seen: int = 0,
    fast_seen: int = 0,
) -> None:
    """``streams`` streams decoding on ``ep``, each of ``out`` tokens having seen ``slow_seen``
    gaps past the ITL bound and ``fast_seen`` within it."""
    c = costs(model, ep)
    for _ in range(streams):
        j = c.start("whole", 10, out, True, model.clock())
        j.first(model.clock())
        for _ in range(slow_seen):
            j.gap(1.0, model.clock())
        for _ in range(fast_seen):
            j.gap(0.01, model.clock())


def prefilled_often(model: CostModel, ep: Endpoint, slow_steps: int) -> None:
    """Prefills placed on ``ep`` lately stretched ``slow_steps`` of its steps."""
    costs(model, ep).slow.add(slow_steps, model.clock())
    model.tick += 1  # changed beneath EngineCosts' methods: its kept figures are stale


def prefills_slowly(model: CostModel, ep: Endpoint) -> None:
    """``ep`` taught the model that it prefills at 3 ms a token, a third of the seed's speed."""
    slow = costs(model, ep)
    for n in (500, 1000, 2000, 3000):
        for _ in range(20):
            slow.prefill.add(n, n * n, slow.steps_of(n), 0.003 * n)
    model.tick += 1


NONE = lambda ep: 0  # noqa: E731 - nothing held anywhere


# ---------------------------------------------------------------------- whole, handoff_not_worth


def test_a_short_prompt_goes_whole_to_the_engine_with_the_shortest_queue() -> None:
    model, planner, clock = setup()
    a, b = engines("a", "b")
    costs(model, a).start("whole", 400, 50, True, clock())  # a has 400 tokens to prefill first
    choice = planner.choose(50, NONE, [a, b], [a, b], 50, clock())
    assert choice is not None
    assert (choice.option.decoder, choice.option.prefiller, choice.reason) == (
        b,
        None,
        "handoff_not_worth",
    )
    # negative control: the queue moved to b, and so does the choice
    model2, planner2, clock2 = setup()
    costs(model2, b).start("whole", 400, 50, True, clock2())
    c2 = planner2.choose(50, NONE, [a, b], [a, b], 50, clock2())
    assert c2 is not None and c2.option.decoder is a


def test_streams_decode_where_gaps_have_been_fast_whatever_made_them_slow() -> None:
    """What the streams on an engine saw counts, whatever made its gaps slow (a prefill the
    router did not place, another tenant of the machine): a short request goes where gaps have
    been within the bound, though its queue is a little longer."""
    model, planner, clock = setup()
    a, b = engines("a", "b")
    c = costs(model, a)
    j = c.start("whole", 10, 400, True, clock())
    j.first(clock())
    for i in range(200):
        j.gap(0.2 if i % 3 == 0 else 0.01, clock())  # a third of a's gaps past the 50 ms bound
    costs(model, b).start("whole", 20, 50, True, clock())  # b: a little queued
    clock.t += 0.5
    choice = planner.choose(50, NONE, [a, b], [a, b], 100, clock())
    assert choice is not None and choice.option.decoder is b
    # negative control: a's gaps were fast; its shorter queue wins
    model2, planner2, clock2 = setup()
    c2 = costs(model2, a)
    j2 = c2.start("whole", 10, 400, True, clock2())
    j2.first(clock2())
    for _ in range(200):
        j2.gap(0.01, clock2())
    costs(model2, b).start("whole", 20, 50, True, clock2())
    clock2.t += 0.5
    c3 = planner2.choose(50, NONE, [a, b], [a, b], 100, clock2())
    assert c3 is not None and c3.option.decoder is a


def test_without_a_second_engine_nothing_is_split() -> None:
    model, planner, clock = setup()
    (a,) = engines("a")
    decoding(model, a, 20, slow_seen=4)  # a long prefill here would harm every stream
    choice = planner.choose(3000, NONE, [a], [a], 50, clock())
    assert choice is not None and choice.option.prefiller is None
    assert choice.reason == "handoff_not_worth"


def crowded(crowd: float) -> tuple[CostModel, Planner, Clock, Endpoint, Endpoint]:
    """Engine a decodes 4 streams and has 400 tokens queued (a short prompt there is predicted
    near its TTFT bound); b is idle; a's steps are ``crowd`` x slower while b works."""
    model, planner, clock = setup()
    a, b = engines("a", "b")
    costs(model, b)
    decoding(model, a, 4)
    costs(model, a).start("whole", 400, 50, True, clock())
    costs(model, a).step.crowding = crowd
    model.crowded = crowd > 0
    return model, planner, clock, a, b


def test_an_idle_engine_is_left_idle_where_its_work_would_crowd_the_streams_elsewhere() -> None:
    """On engines that share a machine (this project's CPU runs: each engine decodes ~2-3 x
    slower while the other works), waking an idle engine stretches every stream decoding on the
    others: a request queues on the busy engine when that costs its TTFT less than the streams'
    ITL."""
    _, planner, clock, a, b = crowded(5.0)  # a's 10 ms steps become 60 ms: past 50 ms
    choice = planner.choose(50, NONE, [a, b], [], 50, clock())
    assert choice is not None and choice.option.decoder is a
    assert choice.option.itl_misses < 0.5
    # negative control: steps that do not crowd; the idle engine's first token comes sooner
    _, planner, clock, a, b = crowded(0.0)
    choice = planner.choose(50, NONE, [a, b], [], 50, clock())
    assert choice is not None and choice.option.decoder is b


def test_on_crowded_engines_requests_gather_where_work_goes_on_anyway() -> None:
    """Both engines at work: a's streams will decode for a while yet, b's last one is nearly
    done. Sending a short request to b keeps b at work past that, crowding a's streams all the
    while; sending it to a costs only its own TTFT risk (400 tokens queued there)."""

    def choose(crowd: float) -> Endpoint:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        decoding(model, a, 4)
        costs(model, a).start("whole", 400, 50, True, clock())
        decoding(model, b, 1, out=100, fast_seen=95)
        for e in (a, b):
            costs(model, e).step.crowding = crowd
        model.crowded = crowd > 0
        choice = planner.choose(50, NONE, [a, b], [], 50, clock())
        assert choice is not None
        return choice.option.decoder

    a, b = engines("a", "b")
    assert choose(5.0).base == a.base
    # negative control: no crowding; b's first token comes sooner
    assert choose(0.0).base == b.base


def test_requests_that_risk_nothing_are_packed_only_where_engines_crowd_each_other() -> None:
    """Engines that slow each other down keep an idle one idle while packing costs nothing;
    engines that do not give a short prompt the earliest first token (a's two streams make its
    step, and so its first token, a little later)."""

    def choose(crowd: float) -> str:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        costs(model, b)
        decoding(model, a, 2)
        for e in (a, b):
            costs(model, e).step.crowding = crowd
        model.crowded = crowd > 0
        choice = planner.choose(20, NONE, [a, b], [], 10, clock())
        assert choice is not None and choice.option.misses < 0.01
        return choice.option.decoder.base

    a, b = engines("a", "b")
    assert choose(0.1) == a.base
    assert choose(0.0) == b.base  # negative control


def test_where_engines_crowd_each_other_one_engine_serves_what_it_can_alone() -> None:
    """Engines that slow each other down by ``CROWD_CONSOLIDATE`` or more (one at work doubles
    the other's steps): a request goes whole to the engine with the most streams while that
    risks at most ``WAKE`` expected misses, though b is predicted to risk less (a's 1,500
    queued tokens put a short prompt there past its TTFT bound, about one miss)."""

    def choose(crowd: float, prompt: int = 50) -> tuple[str, str]:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        costs(model, b)
        decoding(model, a, 4, out=40, fast_seen=10)  # 2 slow gaps of budget each
        costs(model, a).start("whole", 1500, 50, True, clock())
        for e in (a, b):
            costs(model, e).step.crowding = crowd
        model.crowded = crowd > 0
        model.consolidate = crowd >= CROWD_CONSOLIDATE
        choice = planner.choose(prompt, NONE, [a, b], [a, b], 50, clock())
        assert choice is not None
        return choice.option.decoder.base, choice.reason

    a, b = engines("a", "b")
    assert choose(CROWD_CONSOLIDATE) == (a.base, "one_engine_enough")
    # negative controls: engines that do not crowd each other, or less than that (GPUs of their
    # own learn a few tenths); b's first token is in time
    for crowd in (0.0, 0.5):
        decoder, reason = choose(crowd)
        assert decoder == b.base and reason != "one_engine_enough", crowd
    # negative control: a long prompt whole on a would push a's four streams past their ITL
    # p95 (its chunks stretch their steps) and miss its TTFT: more than WAKE; b is woken
    decoder, reason = choose(CROWD_CONSOLIDATE, 6000)
    assert reason != "one_engine_enough", (decoder, reason)


def test_where_engines_crowd_each_other_one_engine_means_the_one_that_serves_best_alone() -> None:
    """Both engines at work: the short prompt goes whole to the one that risks the fewest
    expected misses, not to the one with the most streams (a's streams saw their gaps
    stretched: a decodes slower); alike engines keep it where the most streams are."""

    def choose(a_slow_seen: int) -> tuple[str, str]:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        decoding(model, a, 4, out=40, slow_seen=a_slow_seen, fast_seen=10)
        decoding(model, b, 1, out=40, fast_seen=10)
        for e in (a, b):
            costs(model, e).step.crowding = CROWD_CONSOLIDATE
        model.crowded = model.consolidate = True
        choice = planner.choose(50, NONE, [a, b], [a, b], 40, clock())
        assert choice is not None
        return choice.option.decoder.base, choice.reason

    a, b = engines("a", "b")
    assert choose(a_slow_seen=3) == (b.base, "one_engine_enough")
    assert choose(a_slow_seen=0) == (a.base, "one_engine_enough")  # negative control: alike


def test_where_engines_crowd_each_other_a_prompt_of_several_chunks_is_weighed_everywhere() -> None:
    """The one-engine rule keeps prompts of one chunk only: a longer one is weighed on every
    engine. Here a prompt of two chunks whole on a risks less than ``WAKE`` yet goes to b,
    where it risks less."""

    def choose(prompt: int, where: str = "ab") -> tuple[str, str, float]:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        costs(model, b)
        decoding(model, a, 1, out=40, fast_seen=10)
        costs(model, a).start("whole", 1500, 50, True, clock())
        for e in (a, b):
            costs(model, e).step.crowding = CROWD_CONSOLIDATE
        model.crowded = model.consolidate = True
        pool = [a, b] if where == "ab" else [a]
        choice = planner.choose(prompt, NONE, pool, pool, 50, clock())
        assert choice is not None
        return choice.option.decoder.base, choice.reason, choice.option.misses

    a, b = engines("a", "b")
    chunk = PRIOR_CHUNK_TOKENS
    decoder, reason, misses = choose(chunk + 952, "a")
    assert decoder == a.base and misses <= WAKE  # the rule would have kept it there
    decoder, reason, _ = choose(chunk + 952)
    assert decoder == b.base and reason != "one_engine_enough"
    # negative control: a prompt of one chunk stays on a
    assert choose(chunk)[:2] == (a.base, "one_engine_enough")


def test_a_prefill_is_charged_for_the_arrivals_it_holds_past_their_ttft_bound() -> None:
    """Where the one-engine rule would keep a prompt of one chunk (1.5 s of prefill) whole on
    a, the calls placed on a at 2 a second with 50 ms of TTFT slack would each wait behind it:
    that risks more than ``WAKE``, and its prefill goes to b (whole there, or b prefills it for
    a)."""

    def choose(arrivals: float, slack: float, relaxed: float = 0.0) -> tuple[str, str, float]:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        costs(model, b)
        decoding(model, a, 4, out=40, fast_seen=10)
        ca = costs(model, a)
        for e in (a, b):
            costs(model, e).step.crowding = CROWD_CONSOLIDATE
        model.crowded = model.consolidate = True
        # the rate decays over the window; ``relaxed`` more a second with 20 s of slack
        for rate, s in ((arrivals, slack), (relaxed, 20.0)):
            for _ in range(int(rate * ca.tau)):
                ca.ended(ca.start("decode", 10, 1, True, clock(), slack=s), clock())
        choice = planner.choose(1500, NONE, [a, b], [a, b], 40, clock())
        assert choice is not None
        o = choice.option
        return (o.prefiller or o.decoder).base, choice.reason, o.held_up

    a, b = engines("a", "b")
    prefilled_on, reason, _ = choose(arrivals=2.0, slack=0.05)
    assert prefilled_on == b.base and reason != "one_engine_enough"
    # as many again with seconds to spare (a long prompt's decode leg) take nothing off the
    # short ones' charge: counted by slack, not by a mean of it
    assert choose(arrivals=2.0, slack=0.05, relaxed=2.0)[:2] == (prefilled_on, reason)
    # negative controls: no arrivals, or arrivals with more slack than its prefill takes
    assert choose(arrivals=0.0, slack=0.05) == (a.base, "one_engine_enough", 0.0)
    prefilled_on, reason, held = choose(arrivals=2.0, slack=5.0)
    assert (prefilled_on, reason) == (a.base, "one_engine_enough") and held < 0.05


def test_a_short_prompt_holds_up_no_one() -> None:
    """A prompt within one chunk shares its step with the calls that join it: the charge is
    what its tokens add (about nothing for 20 tokens), not a step; the arrivals' weight decays
    over the window. Negative control: 1,500 tokens, a second and a half of compute."""
    model, planner, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    c.start("whole", 400, 50, True, clock())  # 0.4 s queued ahead
    for _ in range(int(3.0 * c.tau)):
        c.ended(c.start("decode", 10, 1, True, clock(), slack=0.1), clock())
    assert planner.held_up(c, 20, clock()) < 0.01
    long = planner.held_up(c, 1500, clock())
    assert long > 3.0
    clock.t += c.tau  # the window forgets the arrivals
    assert planner.held_up(c, 1500, clock()) == pytest.approx(long / 2.718, rel=1e-3)
    whole = planner.whole(a, 1500, 50, model.ttft_bound(1500), clock())
    assert whole.held_up > 0 and "held_up=" in whole.header()


def test_a_nan_slack_is_not_counted() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    for bad in (math.nan, math.inf, -1.0, 0.0):
        c.start("decode", 10, 1, True, clock(), slack=bad)
    assert c.arrival_rate(clock()) == 0.0
    c.start("decode", 10, 1, True, clock(), slack=0.3)  # negative control
    assert c.arrival_rate(clock()) > 0.0


def test_a_pooled_fit_faster_than_the_seed_is_leant_on_as_it_is() -> None:
    """Engines faster than the seed (0.1 ms a token; the simulated H100s 0.024): an engine of
    short prompts leans on the pooled per-token cost, not on the seed's."""
    model, _, clock = setup(
        Goodput(ttft_seconds=0.5, ttft_seconds_per_kilo_token=1.5, itl_seconds=0.05)
    )
    assert model.pooled_prefill(clock()) is None  # no sample yet
    (a,) = engines("a")
    c = costs(model, a)
    for n in (8000, 200, 4000, 300, 6000, 150) * 10:
        j = c.start("prefill", n, 0, False, clock())
        clock.t += 0.005 + 0.000024 * n + c.step_seconds(0)
        j.end()
        j.answered()
        clock.t += SOLVE_SECONDS
    pooled = model.pooled_prefill(clock())
    assert pooled is not None
    assert pooled(6000, 6000**2, 3) == pytest.approx(0.005 + 0.000024 * 6000, rel=0.2)
    truth = lambda n: 0.005 + 0.000024 * n  # noqa: E731
    rng = random.Random(5)
    samples = [
        (n, truth(n) * rng.uniform(0.9, 1.1)) for n in [rng.randint(100, 300) for _ in range(60)]
    ]
    short_only = PrefillFit(0.02, 1e-4, 0.02)
    for n, y in samples:
        short_only.add(n, n * n, 1, y, solve=False)
    short_only.lean_on(pooled)
    short_only.solve()
    assert short_only(6000, 6000**2, 3) == pytest.approx(truth(6000), rel=0.25)
    # negative control: the pooled per-token cost clamped at the seed's (its floor)
    clamped = PrefillFit(0.02, 1e-4, 0.02)
    for n, y in samples:
        clamped.add(n, n * n, 1, y, solve=False)
    clamped.lean_on(pooled)
    clamped.beta0[1] = max(clamped.floor[1], pooled.beta[1])
    clamped.solve()
    assert clamped(6000, 6000**2, 3) > 1.4 * truth(6000)


def test_arrivals_decayed_lazily_weigh_as_if_decayed_at_each_call() -> None:
    """EngineCosts.arrived scales each new call up by the time since its reference instant
    rather than decaying every bucket at each call; the rate and the weights it implies are
    those of the decay at each call, also past ``REBASE_TAUS`` windows (brought back to now)."""
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    rng = random.Random(7)
    eager = [0.0] * SLACK_BUCKETS
    t_last = 0.0
    for _ in range(400):
        clock.t += rng.uniform(0.0, c.tau / 4)
        slack = rng.choice((0.05, 0.2, 0.9, 3.0))
        if t_last:
            d = math.exp(-(clock.t - t_last) / c.tau)
            eager = [w * d for w in eager]
        t_last = clock.t
        eager[model.slack_bucket(slack)] += 1.0 / c.tau
        c.arrived(slack, clock())
    assert clock.t - 1000.0 > REBASE_TAUS * c.tau  # rebased at least once
    scale = math.exp(-(clock.t - c.arrival_t) / c.tau)
    assert [w * scale for w in c.arrivals] == pytest.approx(eager, rel=1e-9)
    assert c.arrival_rate(clock()) == pytest.approx(sum(eager), rel=1e-9)


def test_an_engines_kept_figures_follow_every_change_to_its_state() -> None:
    """EngineCosts keeps its step, its step with one more stream and its stall per token while
    CostModel.tick stays: each call that changes what they depend on moves it. Negative
    control: asked again with nothing changed, the kept figure is returned."""
    model, planner, clock = setup()
    a, b = engines("a", "b")
    ca, cb = costs(model, a), costs(model, b)
    ca.step.crowding = 1.0
    planner.choose(100, NONE, [a], [a], 10, clock())  # a decision: figures worked out afresh
    alone = ca.step_here()
    assert ca.step_here() == alone == ca.step_seconds(0)  # kept
    job = cb.start("whole", 100, 10, True, clock())  # b at work: a's step crowded
    assert ca.step_here() == ca.step_seconds(0) > alone
    job.first(clock())  # b decodes one more stream
    assert cb.step_here() == cb.step_seconds(1)
    assert cb.step_next() == cb.step_seconds(2)
    clock.t += 0.001
    job.gap(0.5, clock())  # a gap past the bound, ending the step of its prompt: a stall sample
    stall = cb.stall_per_token()
    cb.saw_first_token(100, clock())
    clock.t += 0.001
    cb.saw_gap(0.5, clock())
    assert cb.stall_per_token() != stall
    job.end()
    assert cb.step_here() == cb.step_seconds(0)
    assert ca.step_here() == alone  # b idle again


def test_an_engines_kept_figures_equal_fresh_ones_in_every_state_of_a_busy_trace() -> None:
    """What EngineCosts keeps while CostModel.tick stays (its step now and with one more
    stream, its stall per token, its slow-gap share) and what prefill_figures works out in one
    frame equal the figures worked out afresh (the tick moved by hand), after every kind of
    change a busy router makes: calls of each kind started, first tokens, gaps within and past
    the ITL bound, ends, refreshes at new instants, prefill and step fits solved."""
    model, _, clock = setup()
    a, b = engines("a", "b")
    for e in (a, b):
        costs(model, e).step.crowding = 1.0  # the other engine's work moves this one's step
    model.tick += 1
    rng = random.Random(11)
    checked = 0
    jobs = []

    def check() -> None:
        """Every engine's kept figures read first, then all worked out afresh: a fresh read of
        one engine would move the tick under the other's."""
        nonlocal checked
        now = clock()
        kept = {}
        for x in (a, b):
            cx = costs(model, x)
            if rng.random() < 0.2:
                cx.refresh(now)
            tokens = rng.choice((0, 1, 37, 300, int(cx.chunk_size), int(cx.chunk_size) + 1, 6000))
            got = (cx.step_here(), cx.step_next(), cx.stall_per_token(), cx.slow_share(now))
            kept[x.base] = (tokens, got, cx.prefill_figures(tokens))
        model.tick += 1  # afresh
        for x in (a, b):
            cx = costs(model, x)
            tokens, got, figures = kept[x.base]
            fresh = (
                cx.step_seconds(cx.decoding),
                cx.step_seconds(cx.decoding + 1),
                cx.stall_per_token(),
                cx.slow_share(now),
            )
            assert got == pytest.approx(fresh, rel=1e-12, abs=1e-15)
            want = (cx.prefill_seconds(tokens), cx.slow_steps(tokens))
            assert figures == pytest.approx(want, rel=1e-12, abs=1e-15)
            checked += 1

    for _ in range(300):
        c = costs(model, rng.choice((a, b)))
        clock.t += rng.uniform(0.0, 0.05)
        r = rng.random()
        if r < 0.3 or not jobs:
            kind = rng.choice(("whole", "whole", "prefill", "decode"))
            jobs.append(c.start(kind, rng.randint(1, 3000), rng.randint(1, 64), True, clock()))
        elif r < 0.45:
            rng.choice(jobs).first(clock())
        elif r < 0.7:
            j = rng.choice(jobs)
            j.first(clock())
            j.gap(rng.choice((0.01, 0.04, 0.2, 1.5)), clock())  # within and past the bound
        else:
            j = jobs.pop(rng.randrange(len(jobs)))
            j.end()
            j.answered()
        check()
    assert checked == 600


def test_a_meter_counts_each_call_of_a_decision_as_an_arrival_with_its_slack() -> None:
    model, _, clock = setup()
    a, b = engines("a", "b")
    meter = Meter(model, 100, {}, 10, True, None, slack=0.2)
    meter.job(a.base, a.generation, "prefill")
    meter.job(b.base, b.generation, "decode")
    for e in (a, b):
        c = costs(model, e)
        assert c.arrival_rate(clock()) == pytest.approx(1.0 / c.tau)
        assert c.arrivals[model.slack_bucket(0.2)] == pytest.approx(1.0 / c.tau)
    # the window forgets
    clock.t += costs(model, a).tau
    assert costs(model, a).arrival_rate(clock()) == pytest.approx(
        1.0 / costs(model, a).tau / 2.718, rel=1e-3
    )
    # negative controls: a call no decision placed (no slack) is not counted, nor one already
    # predicted past its bound (nothing placed ahead of it can make it late)
    rate = costs(model, a).arrival_rate(clock())
    costs(model, a).start("whole", 10, 1, True, clock())
    costs(model, a).start("whole", 10, 1, True, clock(), slack=-0.1)
    assert costs(model, a).arrival_rate(clock()) == rate


def test_the_calls_placed_on_an_engine_are_counted_by_their_slack() -> None:
    """Buckets a factor of 2 apart from a quarter of the TTFT bound's fixed part (0.5 s)."""
    model, _, _ = setup()
    assert [model.slack_bucket(x) for x in (0.0, 0.125, 0.17, 0.25, 0.5, 1.0, 1000.0)] == [
        0, 0, 0, 1, 2, 3, SLACK_BUCKETS - 1,
    ]  # fmt: skip


def test_a_call_is_charged_for_crowding_the_whole_of_its_time_only_where_engines_crowd_much() -> (
    None
):
    """a works on for 400 steps anyway, and a at work slows b's streams past their bound: a
    call of 1 s there is charged for the whole second where engines crowd each other as much
    as ``CROWD_CONSOLIDATE`` (the model's ``consolidate``), and only for the time it adds
    below that (none)."""

    def charge(consolidate: bool) -> float:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        decoding(model, b, 4, out=40, fast_seen=10)
        decoding(model, a, 1, out=400)
        for e in (a, b):
            costs(model, e).step.crowding = 5.0
        model.crowded = True
        model.consolidate = consolidate
        return planner.crowding(costs(model, a), 1.0, clock())

    assert charge(True) > 0.1
    assert charge(False) == 0.0


def test_crowding_is_learnt_from_steps_slower_while_the_other_engines_work() -> None:
    """The step alone from the calls decoding while the other engine idled, the crowding from
    those decoding while it worked (gaps 3 x as long: a crowding of 2)."""

    def run(crowded_gap: float) -> EngineCosts:
        model, _, clock = setup()
        a, b = engines("a", "b")
        ca, cb = costs(model, a), costs(model, b)
        for i in range(100):
            clock.t += 1.0
            busy = i % 2 == 1
            other = cb.start("whole", 10, 10, True, clock()) if busy else None
            j = ca.start("whole", 10, 50, True, clock())
            j.first(clock())
            for _ in range(20):
                j.gap(crowded_gap if busy else 0.01, clock())
            j.end()
            if other is not None:
                other.end()
        assert model.busy == 0
        return ca

    ca = run(0.03)
    # (the crowding's firm prior leaves a little of it to the step alone)
    assert ca.step(1) == pytest.approx(0.01, rel=0.15)
    # (from a prior of none, held like two samples: it gets most of the way in 50 of each)
    assert 1.2 < ca.step.crowding < 2.2
    assert ca.step_seconds(1) == pytest.approx(0.01, rel=0.15)  # b idle now
    # negative control: as fast with b at work: no crowding
    ca = run(0.01)
    assert ca.step.crowding < 0.05


# ---------------------------------------------------------------------- split_protects_itl


def test_a_long_prompt_is_prefilled_where_no_stream_decodes_and_decoded_where_none_prefills() -> (
    None
):
    """a has streams decoding (2 slow gaps of budget each, none spent: its gaps are fast), b
    prefills often (a stream there would see its gaps stretched): whole on a stretches a's
    streams for the prompt's three chunks, past their budget; whole on b puts this request's
    decode among b's stretched gaps; prefilling on b and decoding on a does neither."""
    model, planner, clock = setup()
    a, b = engines("a", "b")
    decoding(model, a, 4, out=40, fast_seen=10)
    prefilled_often(model, b, 200)
    choice = planner.choose(6000, NONE, [a, b], [a, b], 100, clock())
    assert choice is not None
    assert (choice.option.prefiller, choice.option.decoder) == (b, a)
    assert choice.reason == "split_protects_itl"
    # negative control: b has not been prefilling (its decodes would not be stretched): whole
    # on b harms nothing and has the earlier first token
    model2, planner2, clock2 = setup()
    decoding(model2, a, 4, out=40, fast_seen=10)
    c2 = planner2.choose(6000, NONE, [a, b], [a, b], 100, clock2())
    assert c2 is not None and (c2.option.decoder, c2.option.prefiller) == (b, None)
    assert c2.reason in ("whole_best", "handoff_not_worth")


def test_the_harm_counts_the_streams_a_prefill_would_push_past_their_budget() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    decoding(model, a, 3, out=100, slow_seen=0)  # 5 slow gaps left each
    decoding(model, a, 2, out=100, slow_seen=4)  # 1 left each
    decoding(model, a, 1, out=100, slow_seen=9)  # already past it: not counted again
    now = clock()
    # no prefill stretching their steps lately: only certain misses count
    assert c.harm(0, now) == 0
    assert c.harm(1, now) == pytest.approx(0, abs=1e-3)
    assert c.harm(2, now) == pytest.approx(2, abs=1e-3)
    assert c.harm(6, now) == pytest.approx(5, abs=1e-3)
    assert c.harm(1.5, now) == pytest.approx(1, abs=1e-3)  # a second step half the time
    # an engine whose steps prefills stretch often (10 a second): spending a stream's spare
    # budget now risks it, and a stream that later stretches will push past it anyway is
    # barely harmed by this one (the harm is the chance this prefill adds)
    prefilled_often(model, a, 1)
    assert 0 < c.harm(1, now) < 1
    prefilled_often(model, a, 50)
    assert c.harm(2, now) < 0.5


def test_a_prompt_stretches_each_chunk_that_may_pass_the_itl_bound() -> None:
    model, _, _ = setup()
    (a,) = engines("a")
    c = costs(model, a)
    assert c.slow_steps(10) < 0.01  # 10 ms step + 10 ms of prefill, far below 50 ms
    assert 0.01 < c.slow_steps(30) < 0.5  # 40 ms: near the bound, a fraction of a step
    assert c.slow_steps(300) == pytest.approx(1, abs=0.01)  # 310 ms: one stretched step
    assert c.slow_steps(3 * 2048) == pytest.approx(3, abs=0.01)  # three chunks of 2,048


# ---------------------------------------------------------------------- split_faster


def test_a_split_wins_on_ttft_where_the_decoders_prefill_slowly() -> None:
    """Fixed pools: the only decoder prefills at a third of the prefiller's speed (what it
    taught the model), so its whole TTFT passes the bound; prefilling apart meets it."""
    model, planner, clock = setup()
    (d,) = engines("d")
    (p,) = engines("p")
    prefills_slowly(model, d)
    choice = planner.choose(2000, NONE, [d], [p], 50, clock())
    assert choice is not None and (choice.option.prefiller, choice.option.decoder) == (p, d)
    assert choice.reason == "split_faster"
    # negative control: the decoder as fast as the prefiller: whole, no hand-off to pay
    _model2, planner2, clock2 = setup()
    c2 = planner2.choose(2000, NONE, [d], [p], 50, clock2())
    assert c2 is not None and c2.option.prefiller is None


# ---------------------------------------------------------------------- whole_best


def test_splits_weighed_and_lost_leave_the_request_whole() -> None:
    """A long prompt on idle engines: the best whole option risks a little (its TTFT near the
    bound), so splits are weighed; none does better (same prefill plus a hand-off)."""
    _model, planner, clock = setup(
        Goodput(ttft_seconds=0.1, ttft_seconds_per_kilo_token=1.0, itl_seconds=0.05, seed=SEED)
    )
    a, b = engines("a", "b")
    choice = planner.choose(1000, NONE, [a, b], [a, b], 50, clock())
    assert choice is not None and choice.option.prefiller is None
    assert choice.reason == "whole_best"
    # negative control: a generous bound, and the cheap test says no split can win
    _model2, planner2, clock2 = setup()
    c2 = planner2.choose(1000, NONE, [a, b], [a, b], 50, clock2())
    assert c2 is not None and c2.reason == "handoff_not_worth"


# ---------------------------------------------------------------------- pairing rules


def test_pairs_keep_one_revision_and_never_an_engine_with_itself() -> None:
    model, planner, clock = setup()
    a, b = engines("a", "b")
    (c,) = engines("c", revision="r2")
    decoding(model, a, 4, out=40, fast_seen=10)
    prefilled_often(model, b, 200)
    # c (another revision) would be the ideal prefiller for a: it holds nothing, harms nothing
    choice = planner.choose(6000, NONE, [a, b, c], [a, b, c], 100, clock())
    assert choice is not None
    o = choice.option
    assert o.prefiller is None or (
        o.prefiller is not o.decoder and o.prefiller.revision == o.decoder.revision
    )
    # an engine of unknown revision pairs with nothing
    (u,) = engines("u", revision=None)
    c2 = planner.choose(2000, NONE, [u], [u, b], 100, clock())
    assert c2 is not None and c2.option.prefiller is None


def test_a_pair_quarantined_for_failed_handoffs_is_not_an_option() -> None:
    """The split that wins (test_a_split_wins_on_ttft_where_the_decoders_prefill_slowly) is
    not taken while its pair is quarantined (pd_router.pairs): the prompt goes whole."""
    pairs = HandoffPairs(Health(passive_failure_threshold=1))
    model = CostModel(SLO, Clock())
    planner = Planner(model, pairs)
    (d,) = engines("d")
    (p,) = engines("p")
    prefills_slowly(model, d)
    pairs.failed(p, d, "5xx")
    c = planner.choose(2000, NONE, [d], [p], 50, model.clock())
    assert c is not None and c.option.prefiller is None
    # negative control: the pair's hand-off succeeds again, and the split is back
    pairs.ok(p, d)
    c2 = planner.choose(2000, NONE, [d], [p], 50, model.clock())
    assert c2 is not None and (c2.option.prefiller, c2.reason) == (p, "split_faster")


def test_what_an_engine_holds_counts_for_it_alone() -> None:
    model, planner, clock = setup()
    a, b = engines("a", "b")
    held = {a.base: 1900, b.base: 0}
    choice = planner.choose(2000, lambda ep: held[ep.base], [a, b], [a, b], 50, clock())
    assert choice is not None and choice.option.decoder is a  # 100 tokens to compute there
    assert choice.option.ttft < costs(model, b).prefill_seconds(2000)


# ---------------------------------------------------------------------- the cost model


def test_a_fit_starts_at_its_prior_and_follows_what_it_sees() -> None:
    f = Fit(0.02, 0.001, 1000.0)
    assert f(1000) == pytest.approx(1.02)
    for i in range(200):
        n = 100 + (i % 10) * 300
        f.add(n, 0.05 + 0.0002 * n)
    assert f(1000) == pytest.approx(0.25, rel=0.05)
    assert f.b == pytest.approx(0.0002, rel=0.1)


def test_the_prefill_fit_learns_what_grows_with_the_square_of_a_prompt() -> None:
    """A truth of 10 ms + 0.1 ms a token + 2e-8 s a token squared + 8 ms a step (the engine's
    decodes batched with each chunk of 2,048): the fit finds each part, so what a chunk adds
    to a decode step is the prefill's own compute."""
    f = PrefillFit(0.02, 0.001, 0.02)
    for i in range(400):
        ns = [100 + (i % 12) * 250] + ([150 + (i % 5) * 100] * (i % 3))  # queued prompts too
        x, x2 = sum(ns), sum(n * n for n in ns)
        steps = sum(-(-n // 2048) for n in ns)
        f.add(x, x2, steps, 0.01 + 1e-4 * x + 2e-8 * x2 + 0.008 * steps)
    assert f.b == pytest.approx(1e-4, rel=0.1) and f.q == pytest.approx(2e-8, rel=0.2)
    assert f.c == pytest.approx(0.008, rel=0.2)
    assert f(3000, 3000**2, 2) == pytest.approx(0.01 + 0.3 + 0.18 + 0.016, rel=0.05)
    # two prompts queued: the squares of each, not of their sum
    assert f(4000, 2 * 2000**2, 2) < f(4000, 4000**2, 2)


def test_a_prefill_fit_coefficient_held_at_zero_leaves_the_others_refitted() -> None:
    """Short prompts take one step each and long ones two, so the intercept and the per-step
    cost are nearly one feature; from a prior above the truth the free solution takes the
    intercept below zero. Held at zero, the rest is solved again: the fit predicts the truth
    (29 ms + 0.153 ms a token, vLLM's CPU build unloaded; noise of mean 1.05)."""
    truth = lambda n: 0.029 + 0.000153 * n  # noqa: E731
    f = PrefillFit(0.05, 1 / 2000, 0.02)
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(2000, 3000) if rng.random() < 0.2 else rng.randint(100, 300)
        f.add(n, n * n, -(-n // 2048), truth(n) * rng.uniform(0.8, 1.3))  # noise of mean 1.05
    assert f(160, 160**2, 1) == pytest.approx(1.05 * truth(160), rel=0.1)
    assert f(2500, 2500**2, 2) == pytest.approx(1.05 * truth(2500), rel=0.1)
    # negative control: the free solution (the same sums and prior) has a negative intercept,
    # and clamping it afterwards predicts a short prompt at least a fifth too slow
    mm = [[e + (f.pw if i == j else 0.0) for j, e in enumerate(row)] for i, row in enumerate(f.m)]
    vv = [e + f.pw * b for e, b in zip(f.v, f.beta0, strict=True)]
    a, b, q, c = _solve(mm, vv) or [0.0] * 4
    assert a < 0
    assert b / 1000 * 160 + q / 1e6 * 160**2 + c > truth(160) * 1.2


def test_a_fit_forgets_old_samples_not_idle_time() -> None:
    f = Fit(0.0, 0.001, 1000.0)
    for n in (500, 1000, 1500) * 100:
        f.add(n, 0.004 * n)  # slow then
    assert f(1000) == pytest.approx(4.0, rel=0.05)
    for n in (500, 1000, 1500) * 100:
        f.add(n, 0.001 * n)  # fast now: the old samples fade
    assert f(1000) == pytest.approx(1.0, rel=0.05)
    # alike samples move the level and keep the slope learnt before
    for _ in range(300):
        f.add(1000, 2.0)
    assert f(1000) == pytest.approx(2.0, rel=0.05) and f.b == pytest.approx(0.001, rel=0.1)


def test_a_whole_stream_teaches_the_prefill_fit_and_moves_to_decoding_at_its_first_token() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    j = c.start("whole", 2000, 50, True, clock())
    assert (c.queued, c.decoding) == (2000, 0)
    clock.t += 0.9
    j.first(clock())
    assert (c.queued, c.decoding) == (0, 1)
    assert c.prefill.n == 1
    j.gap(0.01, model.clock())
    j.gap(0.2, model.clock())  # past the 50 ms bound
    assert (j.gaps, j.slow) == (2, 1)
    j.end()
    assert (c.queued, c.decoding, len(c.jobs)) == (0, 0, 0)
    j.end()  # twice: counted out once
    assert (c.queued, c.decoding) == (0, 0)


def test_a_failed_call_teaches_nothing() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    j = c.start("prefill", 2000, 0, False, clock())
    clock.t += 30
    j.end()  # released without an answer (a timeout): no j.answered()
    assert c.prefill.n == 0 and c.queued == 0
    j2 = c.start("prefill", 2000, 0, False, clock())
    clock.t += 2
    j2.end()
    j2.answered()
    assert c.prefill.n == 1


def test_an_answer_not_streamed_leaves_the_queue_when_its_prefill_should_be_over() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    c.start("whole", 1000, 50, False, clock())
    assert c.queued == 1000
    clock.t += 0.5
    c.refresh(clock())
    assert (c.queued, c.decoding) == (1000, 0)
    clock.t += 1.0  # past the predicted 1.03 s
    c.refresh(clock())
    assert (c.queued, c.decoding) == (0, 1)


def test_an_answer_not_streamed_that_ended_before_its_prefill_was_due_is_forgotten() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    early = c.start("whole", 1000, 50, False, clock())
    running = c.start("whole", 1000, 50, False, clock())
    clock.t += 0.1
    early.end()  # answered long before its predicted prefill end
    assert c.queued == 1000 and len(c.unseen) == 1
    clock.t += 5.0
    c.refresh(clock())
    assert (c.queued, c.decoding) == (0, 1)  # the one still running, not the one that ended
    running.end()
    assert (c.queued, c.decoding, len(c.jobs), len(c.unseen)) == (0, 0, 0, 0)


def test_an_engine_that_prefilled_only_short_prompts_prices_a_token_from_the_pooled_fit() -> None:
    """One step per short prompt: b's own samples cannot tell a token's cost from the step's.
    Held towards the pooled fit, which a's long prompts taught, b prices a long prompt near
    the truth (10 ms + 0.6 ms a token + 20 ms a step, noise of 10 %)."""
    truth = lambda n: 0.01 + 0.0006 * n + 0.02 * -(-n // 2048)  # noqa: E731
    model, _, clock = setup(
        Goodput(ttft_seconds=0.5, ttft_seconds_per_kilo_token=1.5, itl_seconds=0.05)
    )
    a, b = engines("a", "b")
    rng = random.Random(3)

    def prefill(ep: Endpoint, n: int) -> None:
        c = costs(model, ep)
        j = c.start("prefill", n, 0, False, clock())
        clock.t += truth(n) * rng.uniform(0.9, 1.1) + c.step_seconds(0)
        j.end()
        j.answered()
        clock.t += SOLVE_SECONDS

    for _ in range(60):
        prefill(a, rng.randint(100, 3000))
        prefill(b, rng.randint(100, 300))
    costs(model, b).refresh(clock())
    predicted = costs(model, b).prefill(2500, 2500**2, 2)
    assert predicted == pytest.approx(truth(2500), rel=0.25)
    # negative control: the same samples of b alone, from the seed (0.1 ms a token)
    alone = PrefillFit(0.02, 1e-4, 0.02)
    rng = random.Random(3)
    for _ in range(60):
        rng.randint(100, 3000), rng.uniform(0.9, 1.1)
        n = rng.randint(100, 300)
        alone.add(n, n * n, 1, truth(n) * rng.uniform(0.9, 1.1))
    assert abs(alone(2500, 2500**2, 2) / truth(2500) - 1) > 0.4  # 2.28 s against 1.55


def test_prefill_samples_faster_than_a_solve_are_summed_and_solved_by_the_next_decision() -> None:
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    # the same samples solved at once, held towards the pooled fit as the engine's is
    ref = PrefillFit(c.prefill.a, c.prefill.b, c.prefill.c)

    def solved_ref() -> PrefillFit:
        ref.lean_on(model.prefill)
        ref.solve()
        return ref

    def prefill(tokens: int, seconds: float) -> None:
        j = c.start("prefill", tokens, 0, False, clock())
        clock.t += seconds
        j.end()
        j.answered()
        assert j.ahead == (0, 0, 0)  # nothing queued ahead of it
        ref.add(tokens, tokens * tokens, j.steps, seconds - j.step0, solve=False)

    prefill(2000, 4.0)  # the first sample is solved at once
    assert (c.prefill.b, c.prefill.pending) == (solved_ref().b, False)
    b_then = c.prefill.b
    for n in (500, 1000, 1500):
        prefill(n, 0.01)  # 10 ms apart: within SOLVE_SECONDS of each other
    assert c.prefill.pending and c.prefill.n == ref.n == 4
    c.refresh(clock())  # a decision within SOLVE_SECONDS of the last solve: not yet
    assert c.prefill.pending and c.prefill.b == b_then
    clock.t += SOLVE_SECONDS
    c.refresh(clock())  # the next decision after it solves what came
    assert not c.prefill.pending
    fitted = (c.prefill.a, c.prefill.b, c.prefill.q, c.prefill.c)
    ref = solved_ref()
    assert fitted == pytest.approx((ref.a, ref.b, ref.q, ref.c), rel=1e-9)  # the clock's rounding
    assert c.prefill.b != b_then  # negative control: the samples did move it


def test_the_call_a_decision_planned_starts_from_its_predictions() -> None:
    model, planner, clock = setup()
    a, b = engines("a", "b")
    o = planner.whole(a, 1500, 64, 10.0, clock())
    assert o.planned() == (a.base, "whole", o.slow, o.ttft)
    m = Meter(model, 1500, {}, 64, False, o.planned())
    clock.t += 0.001
    costs(model, a).start("whole", 3000, 64, False, clock())  # came in between
    afresh = costs(model, a).prefill_seconds(1500)
    ja = m.job(a.base, a.generation, "whole")
    assert ja.t_due == clock() + o.prefill and ja.slow_steps == o.slow
    assert afresh > o.prefill  # negative control: weighed afresh, it would differ
    # a retry elsewhere is weighed afresh, behind what b has queued
    costs(model, b).start("whole", 3000, 64, False, clock())
    expected = clock() + costs(model, b).prefill_seconds(1500)
    jb = m.job(b.base, b.generation, "whole")
    assert jb.t_due == expected and jb.t_due > ja.t_due


def test_a_restarted_engine_is_learnt_afresh() -> None:
    model, _, _clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    c.prefill.add(1000, 1000 * 1000, 1, 5.0)
    a.generation += 1
    assert costs(model, a) is not c
    assert costs(model, a).prefill.n == 0


def test_a_meter_sizes_each_call_by_what_that_engine_holds() -> None:
    model, _, _clock = setup()
    a, b = engines("a", "b")
    m = Meter(model, 2000, {a.base: 1500}, 64, True)
    ja = m.job(a.base, a.generation, "prefill")
    jb = m.job(b.base, b.generation, "decode")
    assert (ja.tokens, ja.out, jb.tokens, jb.out) == (500, 0, 2000, 64)
    assert costs(model, a).queued == 500 and costs(model, b).decoding == 1


# ---------------------------------------------------------------------- the miss chances


def test_the_miss_chances() -> None:
    assert ttft_miss(1.0, 1.0) == pytest.approx(0.5)
    assert ttft_miss(0.5, 1.0) < 0.02
    assert ttft_miss(2.0, 1.0) > 0.98
    assert poisson_above(0.0, 0) == 0.0
    assert poisson_above(1.0, 0) == pytest.approx(1 - 0.3679, abs=1e-3)
    assert poisson_above(200.0, 150) > 0.99 and poisson_above(100.0, 200) < 0.01


def _stall_run(gap_after_first: float) -> EngineCosts:
    """A stream decoding while 40 prompts of 200 tokens each get their first token after a
    60 ms step; the stream's 60 ms gap is seen ``gap_after_first`` seconds after that token."""
    model, _, clock = setup()
    (a,) = engines("a")
    c = costs(model, a)
    stream = c.start("whole", 10, 1000, True, clock())
    stream.first(clock())
    for _ in range(40):
        clock.t += 1.0
        p = c.start("whole", 200, 10, True, clock())
        clock.t += 0.06
        p.first(clock())
        clock.t += gap_after_first
        stream.gap(0.06, clock())
        p.end()
    return c


def test_the_stall_a_prefill_adds_is_learnt_from_the_gap_that_ended_with_it() -> None:
    """A stream's gap that ends with the step that produced a prompt's first token is that
    step: what it took beyond a decode step, per prompt token, is the stall the next prefill
    of that size is expected to add (not the prefill fit's slope, which queueing inflates)."""
    # the gap ends with the same step: 60 ms step, 10 ms of it decoding: 50 ms / 200 tokens
    assert _stall_run(0.0).stall_per_token() == pytest.approx(0.05 / 200, rel=0.2)
    # negative control: gaps that end far from any first token teach nothing
    assert _stall_run(0.3).stall_xx == 0  # no sample: the prefill fit's slope stands in


def test_with_pairs_out_every_engine_is_weighed_not_only_the_best_few() -> None:
    """Four alike prefillers ahead of a fifth: with each of the four's pair with the decoder out
    (pd_router.pairs), the split the decoder's slow prefill calls for goes to the fifth, not
    whole for want of a pair among the best ``PAIR_CANDIDATES``."""
    pairs = HandoffPairs(Health(passive_failure_threshold=1))
    model = CostModel(SLO, Clock())
    planner = Planner(model, pairs)
    (d,) = engines("d")
    pre = engines("p1", "p2", "p3", "p4", "p5")
    prefills_slowly(model, d)
    for p in pre[:4]:
        pairs.failed(p, d, "5xx")
    c = planner.choose(2000, NONE, [d], pre, 50, model.clock())
    assert c is not None and c.option.prefiller is pre[4]
    # negative control: with no pair out the first of the alike prefillers is taken
    c2 = Planner(model).choose(2000, NONE, [d], pre, 50, model.clock())
    assert c2 is not None and c2.option.prefiller is pre[0]


def test_a_step_fit_held_at_zero_still_gives_a_decision() -> None:
    """The fits hold a coefficient samples take below zero at 0: a step fit whose intercept and
    per-stream cost are both held predicts a step of 0, and the decision takes the log of steps
    (Planner.crowding, EngineCosts.slow_steps). It answered a request 500 so on the real
    engines (ValueError: math domain error, which this test raised before the floor); now a step
    is at least ``STEP_MIN``."""

    def choose(zeroed: bool) -> tuple[str, str]:
        model, planner, clock = setup()
        a, b = engines("a", "b")
        decoding(model, a, 3, out=40, fast_seen=10)
        decoding(model, b, 2, out=40, fast_seen=10)
        for e in (a, b):
            c = costs(model, e)
            c.step.crowding = CROWD_CONSOLIDATE
            if zeroed:
                c.step.s0 = c.step.s1 = 0.0
        model.crowded = model.consolidate = True
        choice = planner.choose(1500, NONE, [a, b], [a, b], 40, clock())
        assert choice is not None
        return choice.option.decoder.base, choice.reason

    assert choose(zeroed=True)[1]  # no ValueError: math domain error
    from pd_router.costs import STEP_MIN

    c = costs(setup()[0], engines("c")[0])
    c.step.s0 = c.step.s1 = 0.0
    assert c.step(4, 1.0) == c.step_seconds(4) == STEP_MIN
    assert c.chunk_seconds(0.0, 0) >= STEP_MIN
