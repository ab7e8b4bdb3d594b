"""Several base models behind one endpoint (pd_router.remotes): a router fronting another
release's router, on simulated engines that serve each model under its own name (the real
engines' turn: tests/real_engine/test_real_multimodel.py). A request for the other model, one
of its adapters or one of its KV revisions is relayed to its router, which decides and serves it
on its own pools; the front's own model never leaves its pools; /v1/models lists both models and
the other's adapters; an unknown name gets vLLM's 404; API keys are the front's, passed on; a
remote that is down is a prompt 503 naming the model, never a hang."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pd_router_dev.devstack import Proc, Stack, free_port
from router_testlib import (
    MODEL,
    greedy_chat,
    http_call,
    metric_value,
    wait_until,
    write_config,
)

OTHER = "qwen-other"  # the other release's model
ADAPTER = "other-sql"  # an adapter of the other model, listed by its engines only
SHARED = "support-bot"  # an adapter both releases serve under one name: the front's own wins
REV = "0123abcd"  # the other release's KV revision (its engines' second served name)
KEY = "sk-shared-by-both-releases"


def _pools(prefill: Proc, decode: Proc) -> dict[str, Any]:
    return {
        "prefill": {"discovery": "static", "static": [prefill.url()]},
        "decode": {"discovery": "static", "static": [decode.url()]},
    }


class Fronted:
    """Release A (``MODEL`` with ``SHARED``: a prefiller and a decoder, threshold 0) whose
    router fronts release B (``OTHER`` with ``ADAPTER`` and ``SHARED``: a prefiller and a
    decoder, threshold 0); both routers take the same API key."""

    def __init__(self, stack: Stack) -> None:
        nixl = ("--kv-connector", "nixl")
        keys = stack.workdir / "mm-keys"
        keys.write_text(KEY + "\n")
        b_engine = (
            *("--model", OTHER, "--alias", f"{OTHER}@kv-{REV}"),
            *("--lora-module", ADAPTER, "--lora-module", SHARED, *nixl),
        )
        self.b_prefill = stack.sim("mm-b-prefill", *b_engine)
        self.b_decode = stack.sim("mm-b-decode", *b_engine)
        a_engine = ("--lora-module", SHARED, *nixl)
        self.a_prefill = stack.sim("mm-a-prefill", *a_engine)
        self.a_decode = stack.sim("mm-a-decode", *a_engine)
        routing = {"connector": "nixl", "threshold": 0, "decision": "length"}
        auth = {"apiKeysFile": str(keys)}
        b_cfg = {
            "model": {"servedName": OTHER, "adapters": [ADAPTER, SHARED]},
            "routing": routing,
            "pools": _pools(self.b_prefill, self.b_decode),
            "auth": auth,
        }
        self.b = stack.router("mm-b-router", write_config(stack.workdir, "mm-b", b_cfg))
        a_cfg = {
            "model": {"servedName": MODEL, "adapters": [SHARED]},
            "remoteModels": [{"name": OTHER, "url": self.b.url()}],
            "routing": routing,
            "pools": _pools(self.a_prefill, self.a_decode),
            "auth": auth,
            "health": {"intervalSeconds": 0.5},
        }
        self.front = stack.router("mm-front", write_config(stack.workdir, "mm-front", a_cfg))
        wait_until(lambda: ADAPTER in self.listed(), "the front to learn the other's adapter")

    def listed(self) -> dict[str, dict[str, Any]]:
        status, _, raw = http_call(
            self.front.url() + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert status == 200, raw
        return {c["id"]: c for c in json.loads(raw)["data"]}

    @staticmethod
    def asked(engine: Proc) -> list[str]:
        _, _, raw = http_call(engine.url() + "/sim/requests")
        return [r["body"].get("model") for r in json.loads(raw)]


@pytest.fixture(scope="module")
def mm(stack: Stack) -> Iterator[Fronted]:
    yield Fronted(stack)


def _chat_key(base: str, model: str, stream: bool) -> tuple[str, str, dict[str, str]]:
    return greedy_chat(base, model, stream, KEY)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", [OTHER, ADAPTER])
def test_the_other_models_requests_are_served_by_its_own_release(
    mm: Fronted, model: str, stream: bool
) -> None:
    theirs_before = mm.asked(mm.b_decode)
    ours_before = {e: len(mm.asked(e)) for e in (mm.a_prefill, mm.a_decode)}
    text, answered, h = _chat_key(mm.front.url(), model, stream)
    # decided and handed off by the other release's router (its x-pd-* headers come back)
    assert (h["x-pd-route"], h["x-pd-reason"]) == ("disaggregated", "always"), h
    assert answered == model
    # its decoder served it (its router names the revision of a hand-off's decode leg)
    assert mm.asked(mm.b_decode)[len(theirs_before) :] in ([model], [f"{OTHER}@kv-{REV}"])
    # the front's own engines were asked nothing
    assert {e: len(mm.asked(e)) for e in (mm.a_prefill, mm.a_decode)} == ours_before
    assert text == _chat_key(mm.b.url(), model, stream)[0]  # what its own router answers


def test_the_fronts_own_model_stays_on_its_pools(mm: Fronted) -> None:
    before = len(mm.asked(mm.b_decode))
    _, answered, h = _chat_key(mm.front.url(), MODEL, False)
    assert (answered, h["x-pd-route"]) == (MODEL, "disaggregated")
    assert len(mm.asked(mm.b_decode)) == before


def test_v1_models_lists_both_models_and_the_others_adapters(mm: Fronted) -> None:
    status, _, raw = http_call(
        mm.front.url() + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    )
    ids = [c["id"] for c in json.loads(raw)["data"]]
    assert sorted(ids) == sorted([MODEL, SHARED, OTHER, ADAPTER])  # each once
    cards = mm.listed()
    assert cards[ADAPTER]["parent"] == OTHER
    assert cards[SHARED]["parent"] == MODEL  # the front's own, not the other's
    assert cards[OTHER]["parent"] is None
    status, _, raw = http_call(
        mm.front.url() + f"/v1/models/{ADAPTER}", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 200 and json.loads(raw)["parent"] == OTHER


def test_names_served_by_neither_get_vllms_404(mm: Fronted) -> None:
    for model in ("no-such-model", f"{OTHER}-typo", "x" * 10_000):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        status, _, raw = http_call(
            mm.front.url() + "/v1/chat/completions",
            "POST",
            body.encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        err = json.loads(raw)["error"]
        assert (status, err["type"], err["param"]) == (404, "NotFoundError", "model"), raw
        assert len(raw) < 1000  # the name quoted bounded


def test_the_front_checks_the_key_before_relaying(mm: Fronted) -> None:
    before = len(mm.asked(mm.b_decode))
    with pytest.raises(openai.AuthenticationError):
        greedy_chat(mm.front.url(), OTHER, False, api_key="sk-wrong")
    assert len(mm.asked(mm.b_decode)) == before


def test_relayed_requests_are_counted_under_route_remote_by_the_configured_name(
    mm: Fronted,
) -> None:
    url = mm.front.url()
    labels = {"model": OTHER, "route": "remote"}
    before = metric_value(url, "pd_router_model_requests_total", labels)
    _chat_key(url, ADAPTER, False)  # an adapter of the remote counts as the remote model
    _chat_key(url, OTHER, True)
    assert metric_value(url, "pd_router_model_requests_total", labels) == before + 2
    _, _, text = http_call(url + "/metrics")
    assert f'model="{ADAPTER}"'.encode() not in text


def test_a_remote_that_is_down_is_a_prompt_503_naming_its_model(stack: Stack) -> None:
    a_decode = stack.sim("mm-down-decode")
    cfg = {
        "model": {"servedName": MODEL},
        "remoteModels": [{"name": OTHER, "url": f"http://127.0.0.1:{free_port()}"}],
        "routing": {"connector": "nixl"},
        "pools": {
            "prefill": {"discovery": "static", "static": [a_decode.url()]},
            "decode": {"discovery": "static", "static": [a_decode.url()]},
        },
    }
    front = stack.router("mm-down-front", write_config(stack.workdir, "mm-down", cfg))
    body = json.dumps({"model": OTHER, "messages": [{"role": "user", "content": "hi"}]})
    status, headers, raw = http_call(
        front.url() + "/v1/chat/completions",
        "POST",
        body.encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 503, raw
    assert OTHER in json.loads(raw)["error"]["message"]
    assert headers.get("retry-after") == "2"
    # listed from the config while its router has never answered
    _, _, raw = http_call(front.url() + "/v1/models")
    assert {c["id"] for c in json.loads(raw)["data"]} >= {MODEL, OTHER}


def test_a_name_both_releases_serve_stays_with_the_fronts_own_engines(mm: Fronted) -> None:
    theirs = len(mm.asked(mm.b_decode))
    _, answered, h = _chat_key(mm.front.url(), SHARED, False)
    assert (answered, h["x-pd-route"]) == (SHARED, "disaggregated")
    assert mm.asked(mm.a_decode)[-1] == SHARED
    assert len(mm.asked(mm.b_decode)) == theirs  # the other release's SHARED: not asked
    status, _, raw = http_call(
        mm.front.url() + f"/v1/models/{SHARED}", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 200 and json.loads(raw)["parent"] == MODEL


def _post(base: str, path: str, obj: dict[str, Any], **headers: str) -> tuple[int, Any]:
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **headers}
    status, _, raw = http_call(base + path, "POST", json.dumps(obj).encode(), hdrs)
    return status, json.loads(raw)


def test_the_others_kv_revision_passthrough_and_request_id_reach_its_router(mm: Fronted) -> None:
    # its KV revision, as its router lists its engines by revision
    assert mm.listed()[OTHER]["kv_revisions"]["decode"] == {REV: 1}
    theirs = len(mm.asked(mm.b_decode))
    body = {"model": f"{OTHER}@kv-{REV}", "messages": [{"role": "user", "content": "hi"}]}
    status, answer = _post(
        mm.front.url(), "/v1/chat/completions", body, **{"X-Request-Id": "mm-rev-1"}
    )
    assert status == 200, answer
    assert len(mm.asked(mm.b_decode)) == theirs + 1
    _, _, raw = http_call(mm.b_decode.url() + "/sim/requests")
    assert json.loads(raw)[-1]["x_request_id"] == "mm-rev-1"
    # vLLM's other endpoints too: its engine tokenizes for its model (the front's would 404)
    status, answer = _post(mm.front.url(), "/tokenize", {"model": OTHER, "prompt": "one two"})
    assert status == 200 and answer["count"] > 0, answer
    status, answer = _post(mm.front.url(), "/tokenize", {"model": "no-such-model", "prompt": "x"})
    assert status == 404, answer  # the negative control: a name nobody serves


def test_a_relayed_request_is_never_relayed_again(mm: Fronted) -> None:
    body = {"model": OTHER, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = _post(mm.front.url(), "/v1/chat/completions", body, **{"X-PD-Relayed": "1"})
    assert status == 508 and OTHER in answer["error"]["message"], answer
    body["model"] = MODEL  # the negative control: its own model is served
    status, answer = _post(mm.front.url(), "/v1/chat/completions", body, **{"X-PD-Relayed": "1"})
    assert status == 200, answer


def test_a_remote_that_accepts_and_never_answers_is_a_504(stack: Stack) -> None:
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # connections complete in the kernel; nobody reads or answers
    try:
        decode = stack.sim("mm-hole-decode")
        cfg = {
            "remoteModels": [{"name": OTHER, "url": f"http://127.0.0.1:{hole.getsockname()[1]}"}],
            "routing": {"connector": "nixl"},
            "pools": _pools(decode, decode),
            "timeouts": {"prefillSeconds": 0.5, "firstByteSeconds": 0.5},
        }
        front = stack.router("mm-hole-front", write_config(stack.workdir, "mm-hole", cfg))
        body = {"model": OTHER, "messages": [{"role": "user", "content": "hi"}]}
        status, answer = _post(front.url(), "/v1/chat/completions", body)
        assert status == 504 and OTHER in answer["error"]["message"], answer
    finally:
        hole.close()
