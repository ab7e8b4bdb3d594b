"""KV-compatibility revisions (pd_router.revision): a prefiller hands its KV only to a decoder
of its own revision, both legs name the revision's model so an engine of another one refuses
them (vLLM's 404), and a long request with no such pair is served directly
(``no_revision_pair``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import AsApp, FakeDownstream, FakeResponse, World, ctx

from pd_router import balancing, revision
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.nixl import NixlRoute

P1, P2, D1, D2 = 9001, 9002, 9101, 9102
A, B = "0a1b2c3d4e", "9f8e7d6c5b"
KVP = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e"}
NOT_FOUND = {"error": {"message": "The model `m@kv-x` does not exist.", "code": 404}}


def completion(text: str, **extra: Any) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}], **extra}


def world(prefill: dict[int, str | None], decode: dict[int, str | None]) -> World:
    w = World(prefill=tuple(prefill), decode=tuple(decode))
    for port, rev in {**prefill, **decode}.items():
        w.ep(port).revision = rev
    return w


def nixl(w: World) -> AsApp:
    d = DirectRoute(w.legs)
    return AsApp(w, NixlRoute(w.legs, d), d)


def serve(w: World, body: dict[str, Any]) -> tuple[FakeDownstream, list[tuple[int, Any]]]:
    down = FakeDownstream()
    asyncio.run(nixl(w).serve(ctx(body), down))
    return down, w.up.calls_to("/v1/completions")


# ---------------------------------------------------------------------- what engines say
def test_the_revision_is_read_from_the_engines_second_served_name() -> None:
    def cards(*ids: str) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}

    assert revision.from_models(cards("m", f"m@kv-{A}"), "m") == A
    assert revision.from_models(cards("m"), "m") == revision.NONE  # not the chart's engine
    assert revision.from_models(cards("m", "m@kv-NOT HEX", "other@kv-" + B), "m") == revision.NONE
    with pytest.raises(ValueError, match="2 revisions"):
        revision.from_models(cards("m", f"m@kv-{A}", f"m@kv-{B}"), "m")
    with pytest.raises(ValueError, match="not a model list"):
        revision.from_models({"data": "x"}, "m")


def test_only_equal_known_revisions_pair() -> None:
    assert revision.pairs(A, A) and revision.pairs("", "")
    assert not revision.pairs(A, B) and not revision.pairs(A, "") and not revision.pairs(None, None)


def test_legs_name_the_revision_only_for_the_served_model() -> None:
    assert revision.leg_model({"model": "m", "x": 1}, "m", A) == {"model": f"m@kv-{A}", "x": 1}
    assert revision.leg_model({"x": 1}, "m", A)["model"] == f"m@kv-{A}"
    lora = {"model": "my-adapter"}
    assert revision.leg_model(lora, "m", A) is lora  # an adapter's name is left alone
    plain = {"model": "m"}
    assert revision.leg_model(plain, "m", "") is plain


# ---------------------------------------------------------------------- the pairing rule
def test_pairing_prefers_the_decisions_decoder_when_its_revision_has_a_prefiller() -> None:
    w = world({P1: A, P2: B}, {D1: A, D2: B})
    for hint, pre in ((w.ep(D1), P1), (w.ep(D2), P2)):
        got = balancing.pair(w.decode.healthy, w.prefill.healthy, hint)
        assert got is not None and (got[0], got[1].port) == (hint, pre)


def test_pairing_moves_off_a_decoder_whose_revision_has_no_prefiller() -> None:
    w = world({P1: B}, {D1: A, D2: B})
    for _ in range(20):  # whatever the random choice
        got = balancing.pair(w.decode.healthy, w.prefill.healthy, w.ep(D1))
        assert got is not None and (got[0].port, got[1].port) == (D2, P1)


def test_no_pair_when_no_decoder_shares_a_prefillers_revision() -> None:
    w = world({P1: B, P2: None}, {D1: A, D2: None})
    assert balancing.pair(w.decode.healthy, w.prefill.healthy) is None


def test_a_long_request_with_no_same_revision_pair_is_served_directly_and_counted() -> None:
    w = world({P1: B}, {D1: A})
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("own")))
    down, calls = serve(w, {"model": "m", "prompt": "long"})
    assert [port for port, _ in calls] == [D1]  # no prefill at all
    assert calls[0][1] == {"model": "m", "prompt": "long"}  # the client's own request
    assert (down.headers["x-pd-route"], down.headers["x-pd-reason"]) == (
        "fallback",
        "no_revision_pair",
    )
    assert down.headers["x-pd-kv-revision"] == A
    assert w.sample("pd_router_fallbacks_total", reason="no_revision_pair") == 1
    assert w.load() == [(0, 0)] * 2


def test_both_legs_name_their_revision_and_the_answer_says_which_served_it() -> None:
    w = world({P1: B, P2: A}, {D1: A})
    w.up.on(P2, "/v1/completions", FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("abc")))
    down, calls = serve(w, {"model": "m", "prompt": "long"})
    (pport, pre), (dport, dec) = calls
    assert (pport, dport) == (P2, D1)
    assert pre["model"] == dec["model"] == f"m@kv-{A}"
    assert down.headers["x-pd-route"] == "disaggregated"
    assert down.headers["x-pd-kv-revision"] == A


# ---------------------------------------------------------------------- vLLM's refusal
def test_a_prefiller_that_refuses_its_revisions_name_is_asked_again_and_the_client_served() -> None:
    w = world({P1: A}, {D1: A})
    w.up.on(P1, "/v1/completions", FakeResponse(404, NOT_FOUND))
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("own")))
    down, calls = serve(w, {"model": "m", "prompt": "long"})
    assert calls[1] == (D1, {"model": "m", "prompt": "long"})
    assert (down.status, down.headers["x-pd-reason"]) == (200, "no_revision_pair")
    ep = w.ep(P1)
    assert ep.revision is None and not ep.learnt and ep.healthy  # re-read at its next check
    assert w.sample("pd_router_upstream_errors_total", pool="prefill", kind="revision") == 1
    # until then it pairs with nothing
    assert balancing.pair(w.decode.healthy, w.prefill.healthy) is None


def test_a_decoder_that_refuses_its_revisions_name_gets_the_clients_own_request() -> None:
    w = world({P1: A}, {D1: A})
    w.up.on(P1, "/v1/completions", FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    w.up.on(
        D1,
        "/v1/completions",
        FakeResponse(404, NOT_FOUND),
        FakeResponse(200, completion("own")),
    )
    down, calls = serve(w, {"model": "m", "prompt": "long"})
    decodes = [b for port, b in calls if port == D1]
    assert decodes[0]["model"] == f"m@kv-{A}" and "kv_transfer_params" in decodes[0]
    assert decodes[1] == {"model": "m", "prompt": "long"}  # no foreign KV, its own name
    assert (down.status, down.json()["choices"][0]["text"]) == (200, "own")
    assert down.headers["x-pd-reason"] == "no_revision_pair"
    assert w.ep(D1).revision is None and w.ep(D1).passive_failures == 0  # not a failure
    assert w.sample("pd_router_fallbacks_total", reason="decode_retry") == 0
    assert w.load() == [(0, 0)] * 2


def test_a_404_for_a_name_without_revision_is_the_clients_answer() -> None:
    w = world({P1: ""}, {D1: ""})
    w.up.on(P1, "/v1/completions", FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    w.up.on(D1, "/v1/completions", FakeResponse(404, NOT_FOUND))
    down, _ = serve(w, {"model": "m", "prompt": "long"})
    assert down.status == 404 and down.headers["x-pd-route"] == "disaggregated"
