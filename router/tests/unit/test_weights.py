"""Weights identity at admission (pd_router.weights): engines of one KV revision that answer the
weights probe differently hold other weights and are paired only within their own set; a long
request whose only same-revision partners differ is served whole (``weights_differ``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import AsApp, FakeDownstream, FakeResponse, World, ctx

from pd_router import balancing, weights
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.nixl import NixlRoute
from pd_router.weights import Fingerprint, WeightSets

P1, P2, D1 = 9001, 9002, 9101
A = "0a1b2c3d4e"
KVP = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e"}


def answer(token: str, top: dict[str, float] | None) -> dict[str, Any]:
    """vLLM 0.31's /v1/completions answer to the probe (``logprobs``: 5)."""
    lp = None
    if top is not None:
        lp = {
            "tokens": [token],
            "token_logprobs": [max(top.values())],
            "top_logprobs": [top],
            "text_offset": [0],
        }
    return {"object": "text_completion", "choices": [{"index": 0, "text": token, "logprobs": lp}]}


TOP = {" fox": -0.9, " dog": -1.4, " cat": -2.0, " the": -2.2, " a": -2.9}


def test_the_probe_asks_one_greedy_token_and_its_top_logprobs() -> None:
    body = weights.probe_body("m")
    assert body["model"] == "m" and body["max_tokens"] == 1 and body["temperature"] == 0
    assert body["logprobs"] == weights.TOP
    assert "model" not in weights.probe_body("")  # vLLM's one served model


def test_answers_of_the_same_weights_match_to_rounding_and_others_do_not() -> None:
    fp = weights.from_answer(answer(" fox", TOP))
    assert fp.token == " fox" and fp.top[0] == (" fox", -0.9) and len(fp.top) == 5
    rounded = weights.from_answer(answer(" fox", {t: v + 0.02 for t, v in TOP.items()}))
    assert fp.matches(rounded) and rounded.matches(fp)
    # negative controls: the same token, logprobs apart; other top tokens
    assert not fp.matches(weights.from_answer(answer(" fox", {t: v - 0.5 for t, v in TOP.items()})))
    other = {" fox": -0.9, " tree": -1.1, " sun": -1.5, " ran": -2.0, " up": -2.5}
    assert not fp.matches(weights.from_answer(answer(" fox", other)))
    # a near tie swapped by rounding (another batch, another GPU): the same weights
    tie = {" fox": -1.40, " dog": -1.41, " cat": -2.0, " the": -2.2, " a": -2.9}
    swapped = {" dog": -1.39, " fox": -1.42, " cat": -2.01, " the": -2.2, " a": -2.9}
    near = weights.from_answer(answer(" fox", tie))
    assert near.matches(weights.from_answer(answer(" dog", swapped)))
    # an engine that says no logprobs (the simulator) is compared on its token
    bare = weights.from_answer(answer(" fox", None))
    assert bare.matches(fp) and not bare.matches(Fingerprint(" dog"))


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"choices": []},
        {"choices": [{"text": 3}]},
        {"choices": [{"text": "x", "logprobs": {"top_logprobs": []}}]},
    ],
)
def test_an_answer_of_another_shape_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        weights.from_answer(bad)


def test_weight_sets_start_at_the_first_seen_and_are_bounded() -> None:
    sets = WeightSets()
    assert sets.place(A, "http://a", Fingerprint("x")) == (0, "http://a")
    assert sets.place(A, "http://b", Fingerprint("x")) == (0, "http://a")
    assert sets.place(A, "http://c", Fingerprint("y")) == (1, "http://a")
    assert sets.place("other", "http://d", Fingerprint("y")) == (0, "http://d")  # per revision
    for i in range(weights.MAX_SETS - 2):
        sets.place(A, f"http://e{i}", Fingerprint(f"z{i}"))
    assert sets.place(A, "http://f", Fingerprint("new")) == (None, "http://a")


def world(sets: dict[int, int | None]) -> World:
    w = World(prefill=(P1, P2), decode=(D1,))
    for port, s in sets.items():
        ep = w.ep(port)
        ep.revision = A
        ep.weights = s
    return w


def test_engines_pair_only_within_one_weight_set_of_their_revision() -> None:
    w = world({P1: 1, P2: 0, D1: 0})
    for _ in range(20):  # whatever the balancer's choice
        got = balancing.pair(w.decode.healthy, w.prefill.healthy, prefill_hint=w.ep(P1))
        assert got is not None and got[1].port == P2
    assert w.ep(P1).pairing == f"{A}~1" and w.ep(P2).pairing == A
    # negative control: the same weights pair as before
    w = world({P1: 0, P2: 0, D1: 0})
    got = balancing.pair(w.decode.healthy, w.prefill.healthy, prefill_hint=w.ep(P1))
    assert got is not None and got[1].port == P1
    # weights not read yet pair with nothing
    w = world({P1: None, P2: None, D1: 0})
    assert balancing.pair(w.decode.healthy, w.prefill.healthy) is None


def serve(w: World) -> tuple[FakeDownstream, list[tuple[int, Any]]]:
    down = FakeDownstream()
    d = DirectRoute(w.legs)
    asyncio.run(
        AsApp(w, NixlRoute(w.legs, d), d).serve(ctx({"model": "m", "prompt": "long"}), down)
    )
    return down, w.up.calls_to("/v1/completions")


def test_a_long_request_whose_partners_hold_other_weights_is_served_whole_and_counted() -> None:
    w = world({P1: 1, P2: 1, D1: 0})
    w.up.on(D1, "/v1/completions", FakeResponse(200, answer("own", None)))
    down, calls = serve(w)
    assert [port for port, _ in calls] == [D1]  # no prefill at all
    assert (down.headers["x-pd-route"], down.headers["x-pd-reason"]) == (
        "fallback",
        "weights_differ",
    )
    assert w.sample("pd_router_fallbacks_total", reason="weights_differ") == 1
    # negative control: the decoder's own set has a prefiller
    w = world({P1: 1, P2: 0, D1: 0})
    w.up.on(
        P2, "/v1/completions", FakeResponse(200, {**answer("a", None), "kv_transfer_params": KVP})
    )
    w.up.on(D1, "/v1/completions", FakeResponse(200, answer("abc", None)))
    down, calls = serve(w)
    assert [port for port, _ in calls] == [P2, D1]
    assert down.headers["x-pd-route"] == "disaggregated"
    # weights not read yet (a probe that failed): not said to differ
    w = world({P1: None, P2: None, D1: 0})
    w.up.on(D1, "/v1/completions", FakeResponse(200, answer("own", None)))
    down, _ = serve(w)
    assert down.headers["x-pd-reason"] == "no_revision_pair"
