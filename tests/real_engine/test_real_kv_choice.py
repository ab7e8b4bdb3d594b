"""The choice between engines of one role from their KV-cache events (pd_router.kv_events), on
real engines: of two prefillers, the one that holds a prompt's prefix prefills it; of two
decoders, a conversation's next turn goes to the one that holds the conversation.

The dense pair (prefiller P on core 0, decoder D on core 1) and a third engine of the same
release (the same KV revision), first a second prefiller X, then a second decoder Y, both on the
decoder's core 1. (In the first two runs, on 2026-12-07, Y was on the prefiller's core while X,
by a fixture bug since mended, still ran: four engines; Y's first pull never completed, vLLM's
request deferred until the router's timeout. Not isolated further: on core 1, X stopped first,
it passes.) Which engine holds what is set up through routers that see one engine of the role
only (a prompt prefilled on X alone, another on P alone; a conversation's first turn
decoded on Y alone, another's on D alone); then a router that sees both must choose the holder.
Each role is checked both ways round (the holder second in the pool, then first), so no fixed
order passes, and ``EACH`` times each way: between idle engines of equal load the router's
balancing (pd_router.balancing: the less loaded of two random picks) chooses at random, so a
router that ignored the events would pass one run in 2 ** (2 x EACH), 1 in 64. Before each
decision the router has applied every batch the engines published (tests/real_engine/events.py ``settle``; a real client does not
wait for that: test_real_kv_events.py's docstring).

What the engines did is read from vLLM's own counters
(``vllm:prompt_tokens_by_source_total``): the prefiller that prefilled is the one whose prompt
tokens grew; the holder reused, from its prefix cache, the blocks the router claimed for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.events import settle
from tests.real_engine.prompts import LONG_WORDS, Answer, ask, text
from tests.real_engine.routers import Routers

BLOCK = 128  # the CPU build's KV block (test_real_kv_events.py)
SUFFIX_WORDS = 400  # about 800 new tokens: past the dev threshold (512) on their own
TURN_WORDS = 60  # a later turn's new message: served where the conversation is
EACH = 3  # prompts (conversations) set up on each holder


@dataclass
class Seen:
    """What one request did to each engine (deltas of vLLM's prompt-token counters)."""

    answer: Answer
    computed: dict[str, float]  # engine name -> prompt tokens computed there
    reused: dict[str, float]  # engine name -> prompt tokens taken from its prefix cache
    pulled: dict[str, float]  # engine name -> prompt tokens pulled over the KV connector

    def worked(self) -> list[str]:
        return sorted(n for n in self.computed if self.computed[n] + self.reused[n] + self.pulled[n] > 0)


class Rig:
    def __init__(self, model: str, named: dict[str, engines.Engine]) -> None:
        self.model, self.named = model, named

    def ask(self, router: Proc, prompt: str | list[dict[str, str]], sees: str) -> Seen:
        """``prompt`` through ``router``, which sees the engines named in ``sees``, once it has
        applied every batch they published."""
        settle([router], [self.named[n] for n in sees])
        before = {n: engines.by_source(e) for n, e in self.named.items()}
        got = ask(router.url(), self.model, isinstance(prompt, list), prompt, False, max_tokens=8)
        after = {n: engines.by_source(e) for n, e in self.named.items()}
        return Seen(
            got,
            {n: after[n]["local_compute"] - before[n]["local_compute"] for n in self.named},
            {n: after[n]["local_cache_hit"] - before[n]["local_cache_hit"] for n in self.named},
            {n: after[n]["external_kv_transfer"] - before[n]["external_kv_transfer"] for n in self.named},
        )


@pytest.fixture(scope="module")
def dense(pairs: Pairs) -> dict[str, engines.Engine]:
    pd = pairs.get("dense")
    assert pd["prefill"].events_port and pd["decode"].events_port, "the chart renders no KV events"
    return pd


@contextlib.contextmanager
def doubled(
    role: str, dense: dict[str, engines.Engine], routers: Routers, workdir: Path
) -> Iterator[tuple[engines.Engine, Proc, Proc, Proc]]:
    """A second engine of ``role`` on the decoder's core (three engines at most: each takes
    about 3.8 GB), with three routers: one that sees the new engine alone in that role, one
    that sees the pair's alone, one that sees both; all stopped on the way out."""
    third = engines.engine(role, "dense", 1, workdir)
    pools = {r: [e.url] for r, e in dense.items()}

    def with_(urls: list[str]) -> Proc:
        each = {**pools, role: urls}
        return routers.start(each["prefill"], each["decode"])

    started: list[Proc] = []
    try:
        third.start()
        engines.wait_ready([third])
        for urls in ([third.url], pools[role], [*pools[role], third.url]):
            started.append(with_(urls))
        yield third, started[0], started[1], started[2]
    finally:
        for r in started:
            r.stop()
        third.stop()


@pytest.fixture(scope="module")
def prefill_choice(
    dense: dict[str, engines.Engine], routers: Routers, workdir: Path, model_name: str
) -> dict[str, Seen]:
    """Prompts A1.. (prefilled on X alone) and B1.. (on P alone), then each followed by new text,
    through the router that sees both prefillers. X and the routers stop before it returns: the
    decoder check's engine replaces X."""
    p, d = dense["prefill"], dense["decode"]
    with doubled("prefill", dense, routers, workdir) as (x, only_x, only_p, both):
        rig = Rig(model_name, {"P": p, "X": x, "D": d})
        seen: dict[str, Seen] = {}
        for i in range(EACH):
            for holder, seeder, sees in (("A", only_x, "XD"), ("B", only_p, "PD")):
                name = f"{holder}{i + 1}"
                prompt = f"[{name}] " + text(f"kv-choice-prefill-{name}", LONG_WORDS)
                seen[f"seed {name}"] = rig.ask(seeder, prompt, sees)
                longer = prompt + " " + text(f"kv-choice-prefill-{name}-more", SUFFIX_WORDS)
                seen[f"{name} and more"] = rig.ask(both, longer, "PXD")
    return seen


@pytest.fixture(scope="module")
def decode_choice(
    dense: dict[str, engines.Engine], prefill_choice: dict[str, Seen], routers: Routers, workdir: Path, model_name: str
) -> dict[str, Seen]:
    """Conversations C1.. (first turn decoded on Y alone) and E1.. (on D alone), then each one's
    second turn through the router that sees both decoders. After the prefill check (its engine
    stopped: ``prefill_choice``)."""
    p, d = dense["prefill"], dense["decode"]
    with doubled("decode", dense, routers, workdir) as (y, only_y, only_d, both):
        rig = Rig(model_name, {"P": p, "D": d, "Y": y})
        seen: dict[str, Seen] = {}
        for i in range(EACH):
            for holder, seeder, sees in (("C", only_y, "PY"), ("E", only_d, "PD")):
                name = f"{holder}{i + 1}"
                msgs = [{"role": "user", "content": f"[{name}] " + text(f"kv-choice-decode-{name}", LONG_WORDS)}]
                first = seen[f"{name} turn 1"] = rig.ask(seeder, msgs, sees)
                msgs += [
                    {"role": "assistant", "content": first.answer.text},
                    {"role": "user", "content": text(f"kv-choice-decode-{name}-turn-2", TURN_WORDS)},
                ]
                seen[f"{name} turn 2"] = rig.ask(both, msgs, "PDY")
    return seen


def summary(seen: dict[str, Seen]) -> str:
    """One line per request: route, reason, the router's estimate and each engine's counters."""
    lines = []
    for step, x in seen.items():
        each = ", ".join(
            f"{n} computed {x.computed[n]:.0f} reused {x.reused[n]:.0f} pulled {x.pulled[n]:.0f}" for n in x.computed
        )
        lines.append(f"{step}: {x.answer.route}/{x.answer.reason}, estimate {x.answer.cached!r}; {each}")
    return "\n".join(lines)


def test_kv_choice_of_two_prefillers_is_the_one_holding_the_prefix(prefill_choice: dict[str, Seen]) -> None:
    s = prefill_choice
    print("\n" + summary(s))
    # the seeds: each disaggregated on its own router's one prefiller
    ways = [
        (f"{h}{i + 1}", holder, other) for i in range(EACH) for h, holder, other in (("A", "X", "P"), ("B", "P", "X"))
    ]
    for name, holder, _ in ways:
        seed = s[f"seed {name}"]
        assert seed.answer.route == "disaggregated", (name, seed)
        assert seed.computed[holder] > 0 and seed.worked() == sorted([holder, "D"]), (name, seed)
    for name, holder, other in ways:
        got = s[f"{name} and more"]
        held = int(s[f"seed {name}"].computed[holder]) // BLOCK * BLOCK
        # past the threshold on the decoder too (it holds the prompt from the seed's hand-off)
        assert got.answer.route == "disaggregated", (name, got)
        # prefilled on the prefiller that holds the prompt, from its prefix cache; the other
        # prefiller did nothing
        assert got.reused[holder] >= held > 0, (name, held, got)
        assert got.computed[other] == 0 and got.reused[other] == 0, (name, got)


def test_kv_choice_of_two_decoders_keeps_a_conversation_where_it_is(decode_choice: dict[str, Seen]) -> None:
    s = decode_choice
    print("\n" + summary(s))
    for name, holder, other in [
        (f"{h}{i + 1}", holder, other) for i in range(EACH) for h, holder, other in (("C", "Y", "D"), ("E", "D", "Y"))
    ]:
        first, second = s[f"{name} turn 1"], s[f"{name} turn 2"]
        assert first.answer.route == "disaggregated" and first.reused[holder] == 0, (name, first)
        assert first.worked() == sorted(["P", holder]), (name, first)
        # the second turn: served on the decoder that holds the conversation, directly, what it
        # reused equal to what the router claimed for it
        assert second.answer.route == "direct" and second.answer.reason == "prefix_cached", (name, second)
        assert second.worked() == [holder], (name, second)
        assert second.answer.cached_source == "events", (name, second)
        assert second.reused[holder] == second.answer.cached_tokens > 0, (name, second)
        assert second.computed[other] == 0, (name, second)
