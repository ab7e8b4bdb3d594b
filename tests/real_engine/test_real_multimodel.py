"""Two base models behind one endpoint on the real engine (issue 35; pd_router.remotes): the dense
pair's release, its router rendered by the chart with ``router.remoteModels`` naming a second
release, whose router serves another model (the tiny hybrid, under a name of its own) on an
engine of its own. Through the first router, each model lands on its own release's engines:

- the first model's long prompt is handed off on its own pair (NIXL), and equals its decoder's
  answer computed there; the second model's is served by its own engine, relayed by the first
  router and decided by the second (its ``x-pd-*`` headers come back), and equals that engine's
  own answer; the two differ (the negative control: one model answering for both would fail it);
- each engine counts exactly the requests of its own model;
- ``/v1/models`` lists both models with the engines' own cards (vLLM's ``max_model_len``).

The second engine shares the decoder's core (three engines at most: each takes about 3.8 GB).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.events import until
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers

OTHER = "tiny-other-model"  # the second release's model.servedName
NEVER = "4000"  # the second router's threshold (below maxModelLen 4096): its engine serves these prompts whole


@pytest.fixture(scope="module")
def other(workdir: Path) -> Iterator[engines.Engine]:
    e = engines.engine("decode", "hybrid", 1, workdir, extra=("--served-model-name", OTHER))
    with engines.running([e]):
        yield e


def _models(base: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        return {c["id"]: c for c in json.loads(r.read())["data"]}


@pytest.fixture(scope="module")
def front(pd: dict[str, engines.Engine], other: engines.Engine, routers: Routers) -> Proc:
    """The first release's router, fronting the second's (both rendered by the chart)."""
    theirs = routers.start(
        [other.url], [other.url], kind="hybrid", sets=(f"model.servedName={OTHER}", f"router.threshold={NEVER}")
    )
    ours = routers.start(
        [pd["prefill"].url],
        [pd["decode"].url],
        sets=(
            f"router.remoteModels[0].name={OTHER}",
            f"router.remoteModels[0].url={theirs.url()}",
            "router.remoteModels[0].release=other",
        ),
    )
    # the second router's list, learnt (its engine's card, not the bare card the config gives)
    until("the front lists its engine's card", lambda: _models(ours.url())[OTHER].get("max_model_len") is not None)
    return ours


@pytest.mark.parametrize("stream", [False, True])
def test_multimodel_each_base_model_is_served_by_its_own_release(
    pd: dict[str, engines.Engine], other: engines.Engine, front: Proc, model_name: str, stream: bool
) -> None:
    every = {"prefill": pd["prefill"], "decode": pd["decode"], "other": other}

    def served() -> dict[str, float]:
        return {n: engines.value(e.metrics(), "vllm:request_success_total") for n, e in every.items()}

    before = served()
    prompt = text(f"multimodel-{stream}", LONG_WORDS)
    ours = ask(front.url(), model_name, True, prompt, stream)
    assert (ours.route, ours.reason) == ("disaggregated", "above_threshold"), ours
    theirs = ask(front.url(), OTHER, True, prompt, stream)
    assert (theirs.route, theirs.reason) == ("direct", "below_threshold"), theirs  # its router's
    # one request each on the first model's pair, one on the second model's engine
    assert served() == {n: v + 1 for n, v in before.items()}
    assert ours.text == colocated(pd["decode"].url, model_name, True, prompt).text
    assert theirs.text == colocated(other.url, OTHER, True, prompt).text
    assert theirs.text != ours.text  # two models: the equalities above mean something
    print(f"\nmultimodel stream={stream}: {ours.prompt_tokens} and {theirs.prompt_tokens} prompt tokens, each equal")


def test_multimodel_v1_models_lists_both_with_the_engines_cards(
    pd: dict[str, engines.Engine], other: engines.Engine, front: Proc, model_name: str
) -> None:
    cards = _models(front.url())
    assert set(cards) == {model_name, OTHER}
    for name, engine in ((model_name, pd["decode"]), (OTHER, other)):
        own = _models(engine.url)[name]
        assert (cards[name]["max_model_len"], cards[name]["owned_by"]) == (own["max_model_len"], own["owned_by"])
