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
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_router_dev.devstack import Proc, Stack
from prometheus_client.parser import text_string_to_metric_families

from tests.real_engine import engines

M = "qwen3.5-9b"  # the dev environment's model.servedName (both engines answer to it)
LONG = "word " * 6000  # over max_model_len (4096) in both tokenizers
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}
OUT_OF_VOCAB = 10**6  # past both vocabularies (the tiny model's 4,096, the simulator's 128,256)
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
    "top_logprobs without logprobs": ("/v1/chat/completions", {**HI, "top_logprobs": 2}),
    "top_logprobs below -1": ("/v1/chat/completions", {**HI, "logprobs": True, "top_logprobs": -3}),
    "top_logprobs not a number": ("/v1/chat/completions", {**HI, "logprobs": True, "top_logprobs": "2"}),
    "top_logprobs over the engine's 20": ("/v1/chat/completions", {**HI, "logprobs": True, "top_logprobs": 50}),
    "logprobs over the engine's 20": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 50}),
    "tools, tool_choice auto, no tool parser": ("/v1/chat/completions", {**HI, "tools": [TOOL], "tool_choice": "auto"}),
    "tools, tool_choice required, no tool parser": ("/v1/chat/completions", {**HI, "tools": [TOOL], "tool_choice": "required"}),
    "tools, a named tool, no tool parser": ("/v1/chat/completions", {**HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get"}}}),
    "tools without tool_choice (auto), no tool parser": ("/v1/chat/completions", {**HI, "tools": [TOOL]}),
    "tool_choice without tools": ("/v1/chat/completions", {**HI, "tool_choice": "auto"}),
    "an empty tools array": ("/v1/chat/completions", {**HI, "tools": []}),
    "empty messages": ("/v1/chat/completions", {"messages": [], "max_tokens": 2}),
    "a token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 2, OUT_OF_VOCAB], "max_tokens": 2}),
    "an image to a text-only model": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 2}),
    "prompt_embeds without --enable-prompt-embeds": ("/v1/completions", {"prompt_embeds": "eHh4eA==", "max_tokens": 2}),
    "beam search streamed": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2, "stream": True}),
}  # fmt: skip
# Refused once generation starts: inside the stream when streaming (a 200, an error event)
STREAM_ERRORS: dict[str, tuple[str, dict[str, Any]]] = {
    "a token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 2, OUT_OF_VOCAB], "max_tokens": 2, "stream": True}),
    "logprobs over the engine's 20": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 50, "stream": True}),
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
    "logprobs 2": ("/v1/completions", {"prompt": "hi", **GREEDY, "logprobs": 2}),
    "logprobs 0 (the sampled token only)": ("/v1/completions", {"prompt": "hi", **GREEDY, "logprobs": 0}),
    "logprobs streamed": ("/v1/completions", {"prompt": "hi", **GREEDY, "logprobs": 2, "stream": True}),
    "chat logprobs, top 2": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat logprobs, no top": ("/v1/chat/completions", {**CHAT, "logprobs": True}),
    "chat logprobs streamed": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True}),
    "chat top_logprobs 0 without logprobs": ("/v1/chat/completions", {**CHAT, "top_logprobs": 0}),
    "tools with tool_choice none": ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "none"}),
    "beam search, greedy, 2 beams": ("/v1/completions", {"prompt": "hi", **GREEDY, "use_beam_search": True, "n": 2}),
}  # fmt: skip


def _choice(ans: tuple[int, Any]) -> dict[str, Any]:
    return ans[1]["choices"][0] if ans[0] == 200 else {}


# What the simulator does not model (its docstring), each probed and checked to be still
# missing (a predicate of the real answer and the simulated one), so the list stays true.
GAPS: dict[str, tuple[str, dict[str, Any], Callable[[Any, Any], bool]]] = {
    "``prompt_logprobs``": ("/v1/completions", {"prompt": "hi there", **GREEDY, "prompt_logprobs": 1},
                            lambda r, s: _choice(r).get("prompt_logprobs") is not None and _choice(s).get("prompt_logprobs") is None),
    "``logprob_token_ids``": ("/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": [5, 7]},
                              lambda r, s: len(_choice(r)["logprobs"]["content"][0]["top_logprobs"]) == 3 and not _choice(s)["logprobs"]["content"][0]["top_logprobs"]),
    "echo": ("/v1/completions", {"prompt": "hi there", **GREEDY, "echo": True},
             lambda r, s: _choice(r)["text"].startswith("hi there") and not _choice(s)["text"].startswith("hi there")),
    "structured outputs": ("/v1/completions", {"prompt": "hi", **GREEDY, "structured_outputs": {"regex": "ab+"}},
                           lambda r, s: re.fullmatch("ab+", _choice(r)["text"]) is not None and re.fullmatch("ab+", _choice(s)["text"]) is None),
    "``truncate_prompt_tokens``": ("/v1/completions", {"prompt": "a b c d e f g h", **GREEDY, "truncate_prompt_tokens": 2},
                                   lambda r, s: r[1]["usage"]["prompt_tokens"] == 2 != s[1]["usage"]["prompt_tokens"]),
    "character-length pre-check": ("/v1/completions", {"prompt": "x" * 300_000, **GREEDY},
                                   lambda r, s: r[0] == 400 and r[1]["error"]["param"] == "input_text" and s[0] == 200),
    "malformed chat ``messages``": ("/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}], **GREEDY},
                                    lambda r, s: r[0] == s[0] == 400 and r[1]["error"]["message"] != s[1]["error"]["message"]),
}  # fmt: skip
# The rest of the simulator's "Not modelled" list, and why no single request shows it here.
UNPROBED = {
    "sampling itself": "the generated text is each model's own: compared by type in every answer",
    "reasoning parsers": "the chart starts no engine with one, and a parser needs a reasoning model",
    "the tools' own pydantic model": "its many wordings; the tool refusals above are matched",
    "LoRA adapters' weights": "test_real_lora.py serves real adapters; the simulator's stand in",
    "KV cache capacity and preemption": "needs a full cache: not one request's answer",
    "``cache_salt``": "changes only what the prefix cache reuses (test_real_kv_events.py)",
    "``remote_prefill_cached_tokens``": "a prefiller's hand-off answer, not the decoder's",
    "0.33 response-shape": "the tier serves vLLM 0.31.0's CPU build only",
}
# Values that are the model's or the moment's own: compared by type only (element by element
# in a list). A logprob entry's ``bytes`` by type alone, and completions' ``top_logprobs``
# dicts, keyed by the model's own tokens, by their size.
OWN = {"id", "created", "system_fingerprint", "text", "content", "root", "prompt_tokens", "total_tokens",
       "token", "logprob", "tokens", "token_logprobs", "text_offset"}  # fmt: skip


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
    if key == "bytes":
        return type(v).__name__
    if key == "top_logprobs" and isinstance(v, dict) and set(v) != {"token", "logprob", "bytes"}:
        return f"{len(v)} tokens"
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


@pytest.mark.parametrize("case", list(STREAM_ERRORS))
def test_errors_found_once_generation_starts_end_the_stream_as_vllms(
    case: str, pd: dict[str, engines.Engine], sim: Proc
) -> None:
    path, body = STREAM_ERRORS[case]
    real, simulated = both(pd["decode"], sim, path, body)
    assert real[0] == 200 and "error" in real[1][0]
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
    path, body, still = GAPS[case]
    real, simulated = both(pd["decode"], sim, path, body)
    assert still(real, simulated), (real, simulated)


def test_every_gap_is_in_the_simulators_list() -> None:
    """Each gap probed or left unprobed is one the simulator's docstring names as not modelled."""
    from pd_router_dev.sim import server

    doc = " ".join((server.__doc__ or "").split())
    listed = doc[doc.index("Not modelled") :]
    assert [g for g in [*GAPS, *UNPROBED] if g not in listed] == []


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
    perf = {f"vllm:estimated_{w}_per_gpu_total" for w in ("flops", "read_bytes", "write_bytes")}
    assert perf <= ours
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
