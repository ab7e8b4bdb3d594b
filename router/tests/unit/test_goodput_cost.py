"""make bench's in-process cost of the goodput decision (pd_router_dev.goodput_cost): it measures
what it says, the goodput decision with its cost meter against the prefix decision, on both
layouts, and its table shows every row."""

from __future__ import annotations

import asyncio

from pd_router_dev import goodput_cost


def test_each_layout_and_load_is_measured_for_both_decisions() -> None:
    rows = goodput_cost.run(batches=1, log=lambda _: None)
    assert [(r["layout"], r["clients"]) for r in rows] == [
        (layout, c) for layout in goodput_cost.LAYOUTS for c in (1, 32)
    ]
    for r in rows:
        assert r["us_goodput"] > 0 and r["us_prefix"] > 0
        assert r["us_more"] == r["us_goodput"] - r["us_prefix"]
    assert len(goodput_cost.table(rows)) == 5 + len(rows)


def test_the_goodput_run_takes_the_goodput_path_with_its_meter() -> None:
    """The short prompt is weighed at its bound by the planner, and each decision carries the
    option and meter the measure then drives (a run that fell back to another path would
    measure nothing of the goodput decision)."""
    from pd_router.config import Health, Routing
    from pd_router.costs import CostModel
    from pd_router.decide import Decider
    from pd_router.pairs import HandoffPairs
    from pd_router.tokens import TokenCounter

    routing = Routing(connector="nixl", threshold=1024, decision="goodput")
    d = Decider(
        routing,
        TokenCounter("", "m"),
        None,
        CostModel(routing.goodput, goodput_cost._Clock()),
        HandoffPairs(Health()),
    )
    got = asyncio.run(
        d.decide(goodput_cost.BODY, True, goodput_cost._no_tokenize, goodput_cost._engines("fixed"))
    )
    assert (got.source, got.reason) == ("bound", "handoff_not_worth")
    assert got.option is not None and got.meter is not None
