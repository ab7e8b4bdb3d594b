"""LoRA adapters behind the router (pd_router.adapters), on simulated engines that serve them as
vLLM does (listed in /v1/models with ``parent``, answers of their own that carry the adapter's
name; the real engine's turn is tests/real_engine/test_real_lora.py): an adapter's request goes
only to a prefiller and a decoder that both list it, else whole to a decoder that does
(``no_adapter_pair``), else a 503 that names it; other names get vLLM's 404; requests are
counted by model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack
from router_testlib import (
    MODEL,
    greedy_chat,
    http_call,
    metric_value,
    wait_until,
    write_config,
)

BOTH = "sql-expert"  # served by the prefiller and the decoder
DECODER_ONLY = "support-bot"  # the prefiller lacks it
NOWHERE = "not-loaded"  # configured in the router, served by no engine


class Lora:
    """Two prefillers and two decoders: the first prefiller and the first decoder hold the
    adapter ``BOTH`` from one path, the second prefiller from another (a new version of it,
    mid-roll), the second decoder no adapter at all; only the first decoder holds
    ``DECODER_ONLY``."""

    def __init__(self, stack: Stack) -> None:
        nixl = ("--kv-connector", "nixl")
        self.prefill = stack.sim("lr-prefill", *nixl, "--lora-module", BOTH)
        self.prefill_v2 = stack.sim(
            "lr-prefill-v2", *nixl, "--lora-module", f"{BOTH}=/adapters/{BOTH}-v2"
        )
        self.decode = stack.sim(
            "lr-decode", *nixl, "--lora-module", BOTH, "--lora-module", DECODER_ONLY
        )
        self.decode_bare = stack.sim("lr-decode-bare", *nixl)
        cfg: dict[str, Any] = {
            "model": {"servedName": MODEL, "adapters": [BOTH, DECODER_ONLY, NOWHERE]},
            "routing": {"connector": "nixl", "threshold": 0, "decision": "length"},
            "pools": {
                "prefill": {
                    "discovery": "static",
                    "static": [self.prefill.url(), self.prefill_v2.url()],
                },
                "decode": {
                    "discovery": "static",
                    "static": [self.decode.url(), self.decode_bare.url()],
                },
            },
            "timeouts": {"prefillSeconds": 3, "firstByteSeconds": 3, "streamIdleSeconds": 5},
        }
        self.router: Proc = stack.router("lr-router", write_config(stack.workdir, "lr-router", cfg))
        # admitted once each engine's /v1/models was read (its adapters with its revision)
        wait_until(self._admitted, "the router to admit the four engines")

    def _admitted(self) -> bool:
        return metric_value(self.router.url(), "pd_router_healthy_endpoints") >= 4

    @staticmethod
    def models_asked(engine: Proc) -> set[str]:
        _, _, raw = http_call(engine.url() + "/sim/requests")
        return {r["body"].get("model") for r in json.loads(raw)}


@pytest.fixture(scope="module")
def lr(stack: Stack) -> Iterator[Lora]:
    yield Lora(stack)


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_both_engines_serve_is_handed_off_and_answers_as_the_adapter(
    lr: Lora, stream: bool
) -> None:
    text, model, h = greedy_chat(lr.router.url(), BOTH, stream)
    assert h["x-pd-route"] == "disaggregated", h.get("x-pd-reason")
    assert model == BOTH
    whole, _, _ = greedy_chat(lr.decode.url(), BOTH, stream)
    base, _, _ = greedy_chat(lr.decode.url(), MODEL, stream)
    assert text == whole
    assert text != base  # the negative control: an adapter answers otherwise


def test_an_adapters_engines_are_those_that_list_it_and_hold_one_version_of_it(lr: Lora) -> None:
    for i in range(6):
        _, model, h = greedy_chat(lr.router.url(), BOTH, i % 2 == 1)
        assert (h["x-pd-route"], model) == ("disaggregated", BOTH), h.get("x-pd-reason")
    # the negative controls of both filters: the engines left out were there to be chosen
    # (base-model requests reach them) and never got the adapter's
    for _ in range(4):
        greedy_chat(lr.router.url(), MODEL, False)
    assert BOTH not in lr.models_asked(lr.prefill_v2)  # its version of the adapter differs
    assert not lr.models_asked(lr.decode_bare) & {BOTH, DECODER_ONLY}  # it lists none
    assert MODEL in lr.models_asked(lr.decode_bare) | lr.models_asked(lr.prefill_v2)


def test_an_adapter_no_prefiller_serves_is_served_whole_by_a_decoder_that_does(lr: Lora) -> None:
    before = metric_value(
        lr.router.url(), "pd_router_fallbacks_total", {"reason": "no_adapter_pair"}
    )
    text, model, h = greedy_chat(lr.router.url(), DECODER_ONLY, False)
    assert (h["x-pd-route"], h["x-pd-reason"]) == ("fallback", "no_adapter_pair")
    assert model == DECODER_ONLY
    assert text == greedy_chat(lr.decode.url(), DECODER_ONLY, False)[0]
    after = metric_value(
        lr.router.url(), "pd_router_fallbacks_total", {"reason": "no_adapter_pair"}
    )
    assert after == before + 1
    served = metric_value(
        lr.router.url(),
        "pd_router_model_requests_total",
        {"model": DECODER_ONLY, "route": "fallback"},
    )
    assert served >= 1


@pytest.mark.parametrize("model", [NOWHERE, f"{MODEL}@kv-0123456789"])
def test_an_adapter_or_revision_no_engine_serves_gets_a_503_naming_it(lr: Lora, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, raw = http_call(
        lr.router.url() + "/v1/chat/completions", "POST", body, {"Content-Type": "application/json"}
    )
    assert status == 503, raw
    assert model.rpartition("@kv-")[2] in json.loads(raw)["error"]["message"]


def test_a_name_neither_served_nor_configured_gets_vllms_404(lr: Lora) -> None:
    for model in ("no-such-adapter", f"{MODEL}@kv-zz"):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        status, _, raw = http_call(
            lr.router.url() + "/v1/chat/completions",
            "POST",
            body.encode(),
            {"Content-Type": "application/json"},
        )
        err = json.loads(raw)["error"]
        assert (status, err["type"], err["param"]) == (404, "NotFoundError", "model"), raw


def test_v1_models_lists_the_model_and_its_adapters_with_their_parent(lr: Lora) -> None:
    status, _, raw = http_call(lr.router.url() + "/v1/models")
    assert status == 200
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    # a decoder's list (decoders are asked first): the adapters it serves (the first decoder
    # answers first), not the one no engine loaded, and not the revisions' own names
    assert set(cards) == {MODEL, BOTH, DECODER_ONLY}
    assert cards[BOTH]["parent"] == cards[DECODER_ONLY]["parent"] == MODEL
    assert cards[MODEL]["parent"] is None
    status, _, raw = http_call(lr.router.url() + f"/v1/models/{BOTH}")
    assert status == 200 and json.loads(raw)["id"] == BOTH
    status, _, _ = http_call(lr.router.url() + f"/v1/models/{NOWHERE}")
    assert status == 404


def test_requests_are_counted_by_the_model_they_named(lr: Lora) -> None:
    url = lr.router.url()

    def count(model: str) -> float:
        return metric_value(url, "pd_router_model_requests_total", {"model": model})

    before = {m: count(m) for m in (MODEL, BOTH)}
    greedy_chat(url, MODEL, False)
    greedy_chat(url, BOTH, False)
    assert count(MODEL) == before[MODEL] + 1
    assert count(BOTH) == before[BOTH] + 1
    # a client's own name is never a label value
    _, _, text = http_call(url + "/metrics")
    assert b'model="no-such-adapter"' not in text
