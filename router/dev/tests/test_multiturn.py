"""``make bench``'s multi-turn chat scenario (pd_router_dev.multiturn) and the decision's cost
(pd_router_dev.decision_cost), run small: the shape of what they report and the routes and
reasons they see, never their timings (those are the bench's output).

Real processes on loopback (simulated engines with delays, our router). Not in the
repository's pytest ``testpaths``: run ``pytest router/dev/tests``.
"""

from __future__ import annotations

from typing import Any

import pytest

from pd_router_dev import bench, decision_cost, multiturn

# one session of two turns from t=0 (its second turn well inside the window), a long and a
# short single prompt; short answers
TINY = multiturn.Spec(
    duration=4.0,
    session_rate=0.3,
    turns=(2, 2),
    first_tokens=(1200, 1400),
    turn_tokens=(20, 40),
    think_s=(0.0, 0.01),
    system_tokens=20,
    long_rate=0.3,
    long_tokens=(1500, 2000),
    short_rate=0.5,
    short_tokens=(20, 40),
    max_tokens=8,
)


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return multiturn.run(TINY, None, None, log=lambda s: None)


def _later(row: dict[str, Any]) -> dict[str, int]:
    return row["reasons_by_class"].get("later turn", {})


def test_the_plan_is_the_same_every_time() -> None:
    a, b = multiturn.plan(TINY), multiturn.plan(TINY)
    assert a == b
    assert a.sessions[0].start == 0.0 and len(a.sessions[0].users) == 2
    assert {p.kind for p in a.singles} == {"long", "short"}
    # a later turn's new tokens are below the threshold, its whole context above
    s = multiturn.Spec()
    assert s.turn_tokens[1] + s.max_tokens < s.threshold < s.first_tokens[0]


def test_word_tokenizer_counts_as_the_simulator(tmp_path: Any) -> None:
    import random

    from pd_router.tokens import load_local_tokenizer
    from pd_router_dev.sim import model as M

    tok = load_local_tokenizer(str(multiturn.word_tokenizer(tmp_path / "tokenizer.json")))
    text = multiturn._text(random.Random(1), 300) + " the router stream, engine."
    assert len(tok.encode(text, add_special_tokens=False).ids) == len(M.tokenize_text(text, False))


def test_three_setups_with_reasons_and_later_turns(rows: list[dict[str, Any]]) -> None:
    assert [r["setup"] for r in rows] == ["colocated", "pd-length", "pd-prefix"]
    for r in rows:
        assert r["errors"] == 0, r
        assert r["later_n"] >= 1 and r["first_n"] >= 1
        assert sum(r["reasons"].values()) == r["requests"]
        assert sum(r["router_decisions"].values()) == r["requests"]
        for key in ("ttft_p50_ms", "later_ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"):
            assert r[key] is not None
        assert all(f["busy_s"] > 0 for f in r["engines"].values())

    colo, length, prefix = rows
    assert set(colo["reasons"]) == {"below_threshold"} and set(colo["routes"]) == {"direct"}
    assert colo["prefill_busy_s"] is None and colo["kv_tokens_moved"] == 0
    # the length rule sends every later turn through the prefiller; the prefix decision
    # serves it on the decoder holding the conversation
    assert set(_later(length)) == {"above_threshold"}
    assert set(_later(prefix)) == {"prefix_cached"}
    assert prefix["router_decisions"].get("direct/prefix_cached") == prefix["later_n"]
    for r in (length, prefix):
        assert r["reasons_by_class"]["turn 1"] == {"above_threshold": r["first_n"]}
        assert r["prefill_busy_s"] > 0 and r["kv_transfers"] > 0
    assert 0 < prefix["kv_tokens_moved"] < length["kv_tokens_moved"]
    assert prefix["kv_transfers"] < length["kv_transfers"]


def test_bench_renders_the_table_and_the_ratios(rows: list[dict[str, Any]]) -> None:
    extra: list[Any] = []
    lines = bench._multiturn_table(rows, extra)
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| setup")]
    assert [ln.split(" | ")[0][2:] for ln in body[:3]] == [r["label"] for r in rows]
    assert any("prefix_cached" in ln for ln in body)
    (cmp,) = extra
    assert cmp["kind"] == "multiturn_ratio"
    assert cmp["kv_tokens"] is not None and cmp["kv_tokens_ok"]
    assert None not in (cmp["later_ttft_p50"], cmp["itl_p99"], cmp["prefill_busy"])
    assert {"later_ttft_p50_ok", "itl_p99_ok", "kv_tokens_ok"} <= set(cmp)


def test_decision_cost_takes_the_paths_it_names() -> None:
    out = decision_cost.run(runs=3, log=lambda s: None)
    by = {r["case"]: r for r in out}
    assert set(by) == {c.key for c in decision_cost.CASES}
    assert set(by["far-length"]["sources"]) == set(by["far-prefix"]["sources"]) == {"sampled"}
    assert set(by["near-length"]["sources"]) == set(by["near-prefix"]["sources"]) == {"tokenizer"}
    for r in out:
        assert r["runs"] == 3 and abs(r["prompt_tokens"] - decision_cost.PROMPT_TOKENS) < 10
        assert 3 < r["bytes_per_token"] < 5
        assert r["loop_cpu_ms"] >= 0 and r["total_cpu_ms"] > 0
        assert (r["total_ok"] is None) == r["case"].startswith("near")
    lines = bench._decision_cost_table(out)
    assert sum(ln.startswith("| far") or ln.startswith("| near") for ln in lines) == 4
