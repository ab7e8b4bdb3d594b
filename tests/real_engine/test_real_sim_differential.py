"""The simulator checked against the real engine, differentially: the same requests to the real
decoder (vLLM 0.31.0's CPU build, as the chart's dev environment configures it) and to a
simulated engine configured alike get the same status codes, the same error bodies word for word
(length rules included), answers and streams of the same shape (every key, every type; the
generated text, ids, times and prompt token counts are the models' own), the same /v1/models
fields and the same metric names and label names. A drift fails here; the simulator is then the
bug. What the simulator does not model (its module docstring) is listed in GAPS and checked to be
still missing, so the list stays true."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_router_dev.devstack import Proc, Stack
from prometheus_client.parser import text_string_to_metric_families

from tests.real_engine import engines

M = "qwen3.5-9b"  # the dev environment's model.servedName (both engines answer to it)
LONG = "word " * 6000  # over max_model_len (4096) in both tokenizers
ERRORS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat prompt over the context": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}),
    "completion prompt over the context": ("/v1/completions", {"prompt": LONG, "max_tokens": 4}),
    "max_tokens over the context": ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}),
    "unknown model": ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    "a wrong type": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    "no messages": ("/v1/chat/completions", {}),
    "stream_options without stream": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}),
    "max_tokens below 1": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    "n 2 when greedy": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 0}),
    "an empty prompt": ("/v1/completions", {"prompt": "", "max_tokens": 3}),
    "min_tokens over max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}),
    "top_p over 1": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": 2}),
}  # fmt: skip
GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
ANSWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", CHAT),
    "completion": ("/v1/completions", {"prompt": "hi", **GREEDY}),
    "chat stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "chat stream with usage": ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    "completion stream with usage": ("/v1/completions", {"prompt": "hi", **GREEDY, "stream": True, "stream_options": {"include_usage": True}}),
    "an unknown field (vLLM ignores it)": ("/v1/completions", {"prompt": "hi", **GREEDY, "frobnicate": 1}),
    "n 2 sampled": ("/v1/completions", {"prompt": "hi", **GREEDY, "temperature": 1.0, "seed": 7, "n": 2}),
}  # fmt: skip
# What the simulator does not model (its docstring), each checked to be still missing.
GAPS: dict[str, tuple[str, dict[str, Any], str]] = {
    "logprobs": ("/v1/completions", {"prompt": "hi", **GREEDY, "logprobs": 2}, "logprobs"),
    "chat logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, "logprobs"),
}  # fmt: skip
# Values that are the model's or the moment's own: compared by type only.
OWN = {"id", "created", "system_fingerprint", "text", "content", "root", "prompt_tokens", "total_tokens"}


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Proc]:
    """A simulated engine configured as the dev environment's decoder (NIXL, 4096, vLLM 0.31)."""
    (workdir / "sim").mkdir(exist_ok=True)
    with Stack(workdir / "sim") as st:
        # the chart's second served name, its KV revision's, as the decoder serves it
        _, alias = engines.chart_engine("decode").served_names
        yield st.sim(
            "diff-sim",
            *("--model", M, "--alias", alias, "--max-model-len", "4096"),
            *("--kv-connector", "nixl", "--vllm-version", "0.31"),
        )


def call(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body or the list of SSE events) of one POST."""
    req = urllib.request.Request(
        base + path, json.dumps({"model": M, **body}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, ctype = err.code, err.read().decode(), err.headers.get("Content-Type", "")
    if ctype.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        return status, [e if e == "[DONE]" else json.loads(e) for e in events]
    return status, json.loads(raw)


def shape(v: Any, key: str = "") -> Any:
    """``v`` with the model's and the moment's own values replaced by their type."""
    if isinstance(v, dict):
        return {k: shape(x, k) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(x, key) for x in v]
    if key in OWN or (isinstance(v, str) and v.startswith("modelperm-")):
        return type(v).__name__
    return v


def both(real: engines.Engine, sim: Proc, path: str, body: dict[str, Any]) -> tuple[tuple[int, Any], tuple[int, Any]]:
    return call(real.url, path, body), call(sim.url(), path, body)


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_and_length_rules_are_vllms_word_for_word(case: str, pd: dict[str, engines.Engine], sim: Proc) -> None:
    path, body = ERRORS[case]
    real, simulated = both(pd["decode"], sim, path, body)
    assert real[0] >= 400
    assert simulated == real


@pytest.mark.parametrize("case", list(ANSWERS))
def test_answers_and_streams_have_vllms_shape(case: str, pd: dict[str, engines.Engine], sim: Proc) -> None:
    path, body = ANSWERS[case]
    real, simulated = both(pd["decode"], sim, path, body)
    assert real[0] == simulated[0] == 200
    assert shape(simulated[1]) == shape(real[1])


@pytest.mark.parametrize("case", list(GAPS))
def test_what_the_simulator_does_not_model_is_still_what_it_says(
    case: str, pd: dict[str, engines.Engine], sim: Proc
) -> None:
    path, body, field = GAPS[case]
    real, simulated = both(pd["decode"], sim, path, body)
    assert real[0] == simulated[0] == 200
    assert real[1]["choices"][0][field] is not None and simulated[1]["choices"][0][field] is None
    # and all the rest has vLLM's shape
    for ans in (real, simulated):
        ans[1]["choices"][0][field] = None
    assert shape(simulated[1]) == shape(real[1])


def test_model_cards_have_vllms_fields(pd: dict[str, engines.Engine], sim: Proc) -> None:
    def cards(base: str) -> Any:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            return json.loads(r.read())

    real, simulated = cards(pd["decode"].url), cards(sim.url())
    assert shape(simulated) == shape(real)
    assert real["data"][0]["id"] == M and real["data"][0]["max_model_len"] == 4096


def families(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_metric_names_and_labels_are_vllms(pd: dict[str, engines.Engine], sim: Proc) -> None:
    real = families(pd["decode"].metrics())
    simulated = families(engines.metrics_text(sim.url()))
    ours = {n for n in simulated if n.startswith("vllm:")}
    assert ours - set(real) == set(), "the simulator exports metrics vLLM does not"
    assert {n: simulated[n] for n in ours if simulated[n] != real[n]} == {}


def test_every_vllm_metric_the_chart_queries_is_exported_by_vllm(pd: dict[str, engines.Engine]) -> None:
    """The alerts, dashboard and autoscalers select series the real engine really exports."""
    import re

    chart = engines.stack.ROOT / "charts" / "pd-inference"
    used = set()
    for f in [*chart.rglob("*.yaml"), *chart.rglob("*.tpl"), *chart.rglob("*.json")]:
        used |= set(re.findall(r"vllm:[a-z_]+", f.read_text()))
    assert len(used) >= 10
    real = families(pd["decode"].metrics())
    assert sorted(used - set(real)) == []


KV_FAIL_CASES = {
    "whole": ("/v1/completions", {"max_tokens": 3}),
    "completion stream": ("/v1/completions", {"max_tokens": 3, "stream": True}),
    "chat stream with usage": ("/v1/chat/completions", {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(KV_FAIL_CASES))
def test_a_failed_kv_load_looks_the_same(case: str, pd: dict[str, engines.Engine], sim: Proc) -> None:
    """vLLM's answer to a decode whose KV cannot be pulled (a prefiller whose side channel
    nobody answers on: it waits for the handshake, then fails the request) and the simulator's
    ``kv_load_fail`` fault."""
    path, extra = KV_FAIL_CASES[case]
    prompt = {"messages": [{"role": "user", "content": "word " * 200}]} if "chat" in path else {"prompt": "word " * 200}
    closed = engines.free_port()  # bound and released: nothing listens
    kv = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
        "remote_engine_id": str(uuid.uuid4()), "remote_request_id": "x", "remote_host": "127.0.0.1",
        "remote_port": closed, "tp_size": 1,
    }  # fmt: skip
    body = {**prompt, **extra, "kv_transfer_params": kv}
    real = call(pd["decode"].url, path, body)
    engines.post(sim.url(), "/sim/fault", {"mode": "kv_load_fail", "count": 1})
    simulated = call(sim.url(), path, body)
    assert real[0] == simulated[0] == (200 if body.get("stream") else 500)
    assert shape(simulated[1]) == shape(real[1])
