"""The simulated engine behaves like the vLLM the chart pins (0.31.0; 0.33.0's length rule
behind ``--vllm-version 0.33``). Each expectation below was read in, or produced by, that
vLLM's own code (``vllm/...`` paths of the installed wheel): error bodies, length rules,
``stream_options``, ``n``, ``stop``, ``/v1/models``, metric names and the chunked-prefill
scheduler. In-process (aiohttp test server); the scheduler is driven with its sleep
replaced, so no test depends on wall-clock time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pd_router_dev.sim import engine as E
from pd_router_dev.sim import model as M
from pd_router_dev.sim import protocol as P
from pd_router_dev.sim.__main__ import parse_args
from pd_router_dev.sim.metrics import VllmMetrics
from pd_router_dev.sim.server import SimConfig, build_app

MODEL = "llama-3.3-70b"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@asynccontextmanager
async def sim(**cfg: Any) -> AsyncIterator[tuple[TestClient, Any]]:
    app, engine = build_app(SimConfig(**cfg))
    async with TestClient(TestServer(app)) as client:
        yield client, engine


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


async def post(c: TestClient, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    r = await c.post(
        path, data=json.dumps(body), headers={"Content-Type": "application/json", **headers}
    )
    text = await r.text()
    if r.content_type == "text/event-stream":
        return r.status, sse(text)
    return r.status, json.loads(text)


def sse(text: str) -> list[Any]:
    out = []
    for event in text.split("\n\n"):
        if event.startswith("data: "):
            data = event.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def err(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------- 1. error bodies
def test_errors_are_nested_with_vllms_types_and_codes() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            status, body = await post(c, CHAT, {"messages": user("x"), "model": "other"})
            assert status == 404
            assert err(body) == {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
            # a VLLMValidationError with a parameter: message suffixed by its __str__
            status, body = await post(c, CHAT, {"messages": user("x"), "temperature": -1})
            assert status == 400
            assert err(body) == {
                "message": "temperature must be non-negative, got -1.0. "
                "(parameter=temperature, value=-1.0)",
                "type": "BadRequestError",
                "param": "temperature",
                "code": 400,
            }
            status, body = await post(c, CMPL, {"prompt": "x", "max_tokens": 6, "min_tokens": 7})
            assert (status, err(body)["param"]) == (400, None)
            assert err(body)["message"] == (
                "min_tokens must be less than or equal to max_tokens=6, got 7."
            )
            # a pydantic type error: FastAPI's handler, HTTPStatus phrase as the type
            status, body = await post(c, CHAT, {"messages": user("x"), "stream": "maybe"})
            assert status == 400
            assert err(body) == {
                "message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': "
                "'body.stream', 'msg': 'Input should be a valid boolean, unable to interpret "
                "input', 'input': 'maybe'}",
                "type": "Bad Request",
                "param": "body.stream",
                "code": 400,
            }
            # lax coercion, as pydantic: "yes" is a boolean, 2.0 an integer
            status, body = await post(
                c, CMPL, {"prompt": "x", "stream": "no", "max_tokens": 2.0, "ignore_eos": 1}
            )
            assert status == 200 and body["usage"]["completion_tokens"] == 2

    run(go)


def test_malformed_json_and_content_type() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            r = await c.post(
                CMPL, data=b'{"prompt": "x",}', headers={"Content-Type": "application/json"}
            )
            assert r.status == 400
            assert err(await r.json()) == {
                "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.15', "
                "'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': "
                "'Expecting property name enclosed in double quotes'}}",
                "type": "Bad Request",
                "param": "body.15",
                "code": 400,
            }
            r = await c.post(CMPL, data=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
            assert r.status == 400
            assert err(await r.json())["message"] == (
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
            )

    run(go)


# ----------------------------------------------------------------------- 2. length rules
def _words(n: int) -> str:
    """A completions prompt of exactly ``n`` tokens (BOS + one per word)."""
    return " ".join(["w"] * (n - 1))


def test_length_rule_0_31_refuses_prompt_plus_max_tokens_over_the_context() -> None:
    async def go() -> None:
        async with sim(max_model_len=100) as (c, _):
            body = {"prompt": [5] * 12, "max_tokens": 90}
            status, got = await post(c, CMPL, body)
            assert status == 400
            assert err(got) == {
                "message": "This model's maximum context length is 100 tokens. However, you "
                "requested 90 output tokens and your prompt contains 12 input tokens, for a "
                "total of 102 tokens. Please reduce the length of the input prompt or the "
                "number of requested output tokens. (parameter=input_tokens, value=12)",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
            body["prompt"] = [5] * 10  # 10 + 90: exactly fits
            status, got = await post(c, CMPL, {**body, "ignore_eos": True})
            assert status == 200 and got["usage"]["completion_tokens"] == 90
            # a text prompt is tokenized with max_length = max_input + 1: "at least"
            status, got = await post(c, CMPL, {"prompt": _words(50), "max_tokens": 95})
            assert status == 400
            assert (
                "your prompt contains at least 6 input tokens, for a total of at least "
                "101 tokens" in err(got)["message"]
            )
            # completions default to max_tokens=16 (also for null), which must fit too
            for extra in ({}, {"max_tokens": None}):
                status, got = await post(c, CMPL, {"prompt": [5] * 85, **extra})
                assert status == 400
                assert "you requested 16 output tokens" in err(got)["message"]
            status, got = await post(c, CMPL, {"prompt": [5] * 84, "ignore_eos": True})
            assert status == 200 and got["usage"]["completion_tokens"] == 16
            # chat without a limit: only the prompt must fit, the answer may fill the rest
            status, got = await post(c, CHAT, {"messages": user(_words(60)), "ignore_eos": True})
            n_prompt = got["usage"]["prompt_tokens"]
            assert status == 200 and got["usage"]["completion_tokens"] == 100 - n_prompt
            assert got["choices"][0]["finish_reason"] == "length"
            status, got = await post(c, CHAT, {"messages": user("x"), "max_completion_tokens": 101})
            assert status == 400
            assert err(got)["message"] == (
                "max_completion_tokens=101 cannot be greater than max_model_len=100. Please "
                "request fewer output tokens. (parameter=max_completion_tokens, value=101)"
            )

    run(go)


def test_length_rule_0_33_clamps_max_tokens_and_refuses_only_long_prompts() -> None:
    async def go() -> None:
        async with sim(max_model_len=100, vllm_version="0.33") as (c, _):
            status, got = await post(
                c, CMPL, {"prompt": [5] * 10, "max_tokens": 95, "ignore_eos": True}
            )
            assert status == 200
            assert got["usage"]["completion_tokens"] == 90  # clamped to what fits
            assert got["choices"][0]["finish_reason"] == "length"
            assert got["system_fingerprint"].startswith("vllm-0.33.0-")
            status, got = await post(c, CMPL, {"prompt": [5] * 102, "max_tokens": 1})
            assert status == 400
            assert err(got) == {
                "message": "This model's maximum context length is 100 tokens. However, your "
                "prompt contains 102 input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt. "
                "(parameter=input_tokens, value=102)",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
            # a prompt that fills the context leaves max_tokens 0, which SamplingParams refuses
            status, got = await post(c, CMPL, {"prompt": [5] * 100})
            assert status == 400
            assert err(got)["message"] == (
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
            )
            # the output limit itself is still checked against the context
            status, got = await post(c, CMPL, {"prompt": "x", "max_tokens": 101})
            assert err(got)["param"] == "max_tokens"

    run(go)


# ----------------------------------------------------------------------- 3. stream_options
def test_stream_options_need_stream_true() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            for path, base in ((CMPL, {"prompt": "x"}), (CHAT, {"messages": user("x")})):
                for stream in ({}, {"stream": False}):
                    body = {**base, **stream, "stream_options": {"include_usage": True}}
                    status, got = await post(c, path, body)
                    assert status == 400
                    assert err(got) == {
                        "message": "Stream options can only be defined when `stream=True`. "
                        "(parameter=stream_options)",
                        "type": "BadRequestError",
                        "param": "stream_options",
                        "code": 400,
                    }
                # an empty dict is falsy for vLLM's check: accepted
                status, _ = await post(c, path, {**base, "stream_options": {}, "max_tokens": 1})
                assert status == 200

    run(go)


# ----------------------------------------------------------------------- 4. n > 1
def test_n_choices_non_streaming() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            base = {"messages": user("tell me"), "max_tokens": 12, "ignore_eos": True}
            _, one = await post(c, CHAT, base)
            _, three = await post(c, CHAT, {**base, "n": 3})
            choices = three["choices"]
            assert [ch["index"] for ch in choices] == [0, 1, 2]
            texts = [ch["message"]["content"] for ch in choices]
            assert texts[0] == one["choices"][0]["message"]["content"]
            assert len(set(texts)) == 3  # distinct, and reproducible:
            _, again = await post(c, CHAT, {**base, "n": 3})
            assert [ch["message"]["content"] for ch in again["choices"]] == texts
            usage = three["usage"]
            assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt once
            assert usage["completion_tokens"] == 36
            # completions: prompts x n choices, each prompt counted once
            status, got = await post(
                c, CMPL, {"prompt": ["a b", "c d e"], "n": 2, "max_tokens": 3, "ignore_eos": True}
            )
            assert status == 200 and [ch["index"] for ch in got["choices"]] == [0, 1, 2, 3]
            assert got["usage"] == {
                "prompt_tokens": 3 + 4,
                "total_tokens": 7 + 12,
                "completion_tokens": 12,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            }
            # greedy sampling refuses n > 1
            status, got = await post(c, CHAT, {**base, "n": 2, "temperature": 0})
            assert status == 400
            assert err(got)["message"] == "n must be 1 when using greedy sampling, got 2."

    run(go)


def test_n_choices_streaming() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            body = {
                "messages": user("tell me"),
                "max_tokens": 5,
                "ignore_eos": True,
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            _, events = await post(c, CHAT, body)
            assert events[-1] == "[DONE]"
            usage = events[-2]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
            chunks = events[:-2]
            # a role chunk per choice first, then one chunk per token per index
            assert [ch["choices"][0]["delta"] for ch in chunks[:2]] == [
                {"role": "assistant", "content": ""}
            ] * 2
            assert [ch["choices"][0]["index"] for ch in chunks[:2]] == [0, 1]
            for i in (0, 1):
                mine = [ch["choices"][0] for ch in chunks[2:] if ch["choices"][0]["index"] == i]
                assert len(mine) == 5
                assert [x["finish_reason"] for x in mine] == [None] * 4 + ["length"]
            _, full = await post(c, CHAT, {**body, "stream": False, "stream_options": None})
            for i in (0, 1):
                text = "".join(
                    ch["choices"][0]["delta"]["content"]
                    for ch in chunks
                    if ch["choices"][0]["index"] == i
                )
                assert text == full["choices"][i]["message"]["content"]

    run(go)


# ----------------------------------------------------------------------- 5. stop
def _answer_tokens(prompt: str, n: int) -> list[int]:
    gen = M.Generator(M.tokenize_text(prompt), ignore_eos=True)
    return [gen.step() for _ in range(n)]


def _unique_word(words: list[str], lo: int) -> int:
    """Index k >= lo of a word whose text occurs exactly once in the whole answer."""
    text = "".join(words)
    return next(k for k in range(lo, len(words)) if text.count(words[k].strip()) == 1)


def test_stop_strings_cut_the_answer_and_set_stop_reason() -> None:
    prompt = "the stop test"
    toks = _answer_tokens(prompt, 12)
    words = [M.token_text(t) for t in toks]
    k = _unique_word(words, 3)
    stop = words[k].strip()
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stop": ["zzz", stop]}

    async def go() -> None:
        async with sim() as (c, _):
            _, got = await post(c, CMPL, body)
            ch = got["choices"][0]
            assert ch["text"] == "".join(words[:k])  # excluded by default
            assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", stop)
            assert got["usage"]["completion_tokens"] == k + 1  # the stopping token counts
            _, got = await post(c, CMPL, {**body, "include_stop_str_in_output": True})
            assert got["choices"][0]["text"] == "".join(words[:k]) + stop
            # streamed: the same text, and no part of the stop string is ever sent
            _, events = await post(c, CMPL, {**body, "stream": True})
            texts = [e["choices"][0]["text"] for e in events[:-1]]
            assert "".join(texts) == "".join(words[:k])
            assert events[-2]["choices"][0]["stop_reason"] == stop
            # not looked for while the first min_tokens tokens come: the answer runs on
            _, got = await post(c, CMPL, {**body, "min_tokens": k + 1})
            ch = got["choices"][0]
            assert (ch["finish_reason"], ch["stop_reason"]) == ("length", None)
            assert ch["text"] == "".join(words)

    run(go)


def test_stop_token_ids() -> None:
    prompt = "stop token ids"
    toks = _answer_tokens(prompt, 10)
    k = next(i for i in range(3, 10) if toks[i] not in toks[:i])
    body = {"prompt": prompt, "max_tokens": 10, "ignore_eos": True, "stop_token_ids": [toks[k]]}

    async def go() -> None:
        async with sim() as (c, _):
            _, got = await post(c, CMPL, body)
            ch = got["choices"][0]
            assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", toks[k])
            assert got["usage"]["completion_tokens"] == k + 1
            assert ch["text"] == "".join(M.token_text(t) for t in toks[:k])  # its text not
            # min_tokens: the stop token is not sampled while fewer tokens than that came,
            # so the answer goes on past where it stopped
            _, got = await post(c, CMPL, {**body, "min_tokens": k + 1})
            ch = got["choices"][0]
            assert ch["text"].startswith("".join(M.token_text(t) for t in toks[:k]))
            assert got["usage"]["completion_tokens"] > k + 1 or ch["stop_reason"] is None
            status, got = await post(c, CMPL, {**body, "stop": ""})
            assert status == 400
            assert err(got)["message"] == "stop cannot contain an empty string."

    run(go)


def _tok(word: str) -> int:
    return M.OUT_BASE + M._WORDS.index(word)


def test_text_state_holds_back_what_could_start_a_stop_string() -> None:
    st = M.TextState(["bright river"], include=False, min_tokens=0)
    # 11 characters (len("bright river") - 1) are held back while the sequence runs
    assert st.add(_tok("the"), False) is None and st.delta(False) == ""
    assert st.add(_tok("bright"), False) is None and st.delta(False) == ""
    assert st.add(_tok("river"), False) == "bright river"
    assert st.text == "the " and st.delta(True) == "the "
    st = M.TextState(["bright river"], include=False, min_tokens=0)
    for w in ("the", "cloud", "was", "new"):
        st.add(_tok(w), False)
    assert st.delta(False) == "the cloud was new "[:-11]
    assert st.delta(True) == "the cloud was new "[-11:]


# ----------------------------------------------------------------------- 6. /v1/models
def test_models_card_as_vllm_0_31() -> None:
    async def go() -> None:
        async with sim(max_model_len=4096) as (c, _):
            r = await c.get("/v1/models")
            got = await r.json()
            assert got["object"] == "list" and len(got["data"]) == 1
            card = got["data"][0]
            assert list(card) == [
                "id", "object", "created", "owned_by", "root", "parent", "max_model_len",
                "permission",
            ]  # fmt: skip
            assert card["id"] == MODEL and card["object"] == "model"
            assert card["owned_by"] == "vllm" and card["parent"] is None
            assert card["max_model_len"] == 4096 and isinstance(card["created"], int)
            (perm,) = card["permission"]
            assert perm["id"].startswith("modelperm-") and perm["object"] == "model_permission"
            assert {k: v for k, v in perm.items() if k not in ("id", "created")} == {
                "object": "model_permission",
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }

    run(go)


# ----------------------------------------------------------------------- response shapes
def test_response_and_chunk_fields_as_vllm_0_31() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            _, got = await post(
                c, CHAT, {"messages": user("x"), "max_tokens": 2}, **{"X-Request-Id": "abc"}
            )
            assert got["id"] == "chatcmpl-abc"  # _base_request_id: the header
            assert list(got) == [
                "id", "object", "created", "model", "choices", "service_tier",
                "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
                "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
            ]  # fmt: skip
            assert list(got["choices"][0]["message"]) == [
                "role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"
            ]  # fmt: skip
            _, got = await post(c, CMPL, {"prompt": "x", "max_tokens": 2, "request_id": "r1"})
            assert got["id"] == "cmpl-r1"
            assert list(got["choices"][0]) == [
                "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                "prompt_logprobs", "prompt_token_ids", "routed_experts",
            ]  # fmt: skip
            _, events = await post(
                c, CMPL, {"prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True}
            )
            first, last = events[0], events[-2]
            assert list(first["choices"][0]) == [
                "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
                "token_ids",
            ]  # fmt: skip
            assert "system_fingerprint" not in first and "system_fingerprint" in last
            # an empty token prompt fails once generation starts: in the stream
            status, events = await post(c, CMPL, {"prompt": [[]], "stream": True})
            assert (
                status == 200 and err(events[0])["message"] == "The decoder prompt cannot be empty"
            )
            status, got = await post(c, CMPL, {"prompt": [[]]})
            assert status == 400 and err(got)["message"] == "The decoder prompt cannot be empty"

    run(go)


# ----------------------------------------------------------------------- 7. metrics
def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


EXPECTED_0_31 = {
    # name (as the parser reports it) -> (type, extra label)
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:num_requests_waiting_by_reason": ("gauge", "reason"),
    "vllm:engine_sleep_state": ("gauge", "sleep_state"),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:external_prefix_cache_queries": ("counter", None),
    "vllm:external_prefix_cache_hits": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:prompt_tokens_by_source": ("counter", "source"),
    "vllm:prompt_tokens_cached": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", "finished_reason"),
    "vllm:request_prompt_tokens": ("histogram", None),
    "vllm:request_generation_tokens": ("histogram", None),
    "vllm:iteration_tokens_total": ("histogram", None),
    "vllm:request_max_num_generation_tokens": ("histogram", None),
    "vllm:request_params_n": ("histogram", None),
    "vllm:request_params_max_tokens": ("histogram", None),
    "vllm:time_to_first_token_seconds": ("histogram", None),
    "vllm:inter_token_latency_seconds": ("histogram", None),
    "vllm:request_time_per_output_token_seconds": ("histogram", None),
    "vllm:e2e_request_latency_seconds": ("histogram", None),
    "vllm:request_queue_time_seconds": ("histogram", None),
    "vllm:request_inference_time_seconds": ("histogram", None),
    "vllm:request_prefill_time_seconds": ("histogram", None),
    "vllm:request_decode_time_seconds": ("histogram", None),
    "vllm:request_num_preemptions": ("histogram", None),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", None),
}


def _sample(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"{sample} {labels} missing")


def test_metric_names_types_and_labels() -> None:
    async def go() -> None:
        async with sim() as (c, _):
            fams = _families(await (await c.get("/metrics")).text())
            for name, (mtype, extra) in EXPECTED_0_31.items():
                assert name in fams, name
                assert fams[name].type == mtype, name
                for s in fams[name].samples:
                    want = {"model_name", "engine"} | ({extra} if extra else set())
                    if s.name.endswith("_bucket"):
                        want.add("le")
                    assert set(s.labels) == want, (name, s)
                    assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0"
            reasons = {
                s.labels["finished_reason"]
                for s in fams["vllm:request_success"].samples
                if s.name == "vllm:request_success_total"
            }
            assert reasons == {"stop", "length", "abort", "error", "repetition"}
            assert not any(n.startswith("vllm:nixl") for n in fams)  # no NIXL connector
            assert "pd_sim_aborted" in fams and "pd_sim_kv_remote_prefill" in fams

            _, got = await post(
                c, CMPL, {"prompt": [7] * 9, "max_tokens": 4, "ignore_eos": True, "n": 2}
            )
            assert got["usage"]["completion_tokens"] == 8
            after = _families(await (await c.get("/metrics")).text())
            assert _sample(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 18
            assert _sample(after, "vllm:generation_tokens", "vllm:generation_tokens_total") == 8
            assert (
                _sample(
                    after,
                    "vllm:request_success",
                    "vllm:request_success_total",
                    finished_reason="length",
                )
                == 2
            )  # each of the n sequences is a request to the engine
            fam = "vllm:time_to_first_token_seconds"
            assert _sample(after, fam, fam + "_count") == 2
            fam = "vllm:request_params_n"
            assert _sample(after, fam, fam + "_sum") == 2  # once per parent, its n
            fam = "vllm:request_prompt_tokens"
            assert _sample(after, fam, fam + "_bucket", le="10.0") == 2

    run(go)


@pytest.mark.parametrize("version", ["0.31", "0.33"])
def test_nixl_engine_exports_the_nixl_connector_metrics(version: str) -> None:
    fams = _families(VllmMetrics(MODEL, 1024, "nixl", version).render().decode())
    names = {
        "vllm:nixl_xfer_time_seconds": "histogram",
        "vllm:nixl_post_time_seconds": "histogram",
        "vllm:nixl_bytes_transferred": "histogram",
        "vllm:nixl_num_descriptors": "histogram",
        "vllm:nixl_num_failed_transfers": "counter",
        "vllm:nixl_num_failed_notifications": "counter",
        "vllm:nixl_num_kv_expired_reqs": "counter",
    }
    for name, mtype in names.items():
        assert fams[name].type == mtype
    assert ("vllm:nixl_num_notifications_after_expiry" in fams) == (version == "0.33")


def test_nixl_prefill_answer_and_decoder_metrics() -> None:
    async def go() -> None:
        async with sim(kv_connector="nixl", prefix_cache_tokens=0) as (c, engine):
            body = {
                "prompt": [3] * 40,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            _, got = await post(c, CMPL, body, **{"X-Request-Id": "p1"})
            kv = got["kv_transfer_params"]
            assert kv["remote_block_ids"] == [[0, 1, 2]]  # per KV-cache group
            assert (
                kv["remote_request_id"] == "cmpl-p1" and kv["remote_engine_id"] == engine.engine_id
            )
            assert (kv["remote_num_tokens"], kv["transfer_mode"]) == (40, "pull")
            _, got = await post(
                c, CMPL, {"prompt": [3] * 40, "max_tokens": 2, "kv_transfer_params": kv}
            )
            assert got["usage"]["completion_tokens"] == 2
            fams = _families(await (await c.get("/metrics")).text())
            fam = "vllm:nixl_xfer_time_seconds"
            assert _sample(fams, fam, fam + "_count") == 1
            fam = "vllm:prompt_tokens_by_source"
            src = _sample(fams, fam, fam + "_total", source="external_kv_transfer")
            assert src == 39  # all but the last prompt token came over NIXL

    run(go)


# ----------------------------------------------------------------------- 8. chunked prefill
class _Cfg:
    prefill_ms_per_token = 1.0
    decode_step_ms = 10.0
    decode_step_ms_per_seq = 2.0
    slow_factor = 20.0
    max_num_batched_tokens = 100
    max_num_seqs = 1024


def _drive(cfg: Any, prompts: list[tuple[int, int]]) -> tuple[list[float], list[list[int]]]:
    """Run the engine loop until every sequence is done, its sleep recorded instead of
    slept: each step's duration (ms) and which sequences sampled a token in it."""

    async def go() -> tuple[list[float], list[list[int]]]:
        metrics = VllmMetrics(MODEL, 4096, "none", "0.31")
        eng = E.Engine(cfg, {"fault": "none"}, metrics)
        runs = []
        for i, (n_prompt, max_tokens) in enumerate(prompts):
            r = E.Run(metrics, 1)
            E.Seq(r, i, 0, [5] * n_prompt, max_tokens, 4096, n_prompt, ignore_eos=True)
            runs.append(r)
        seqs = [r.seqs[0] for r in runs]
        durations: list[float] = []
        sampled: list[list[int]] = []
        seen = [0] * len(seqs)

        def tokens_so_far() -> None:
            now = [s.n_out for s in seqs]
            sampled.append([i for i, (a, b) in enumerate(zip(seen, now, strict=True)) if b > a])
            seen[:] = now

        async def record(seconds: float) -> None:
            tokens_so_far()  # what the previous step sampled
            durations.append(round(seconds * 1000, 6))
            await asyncio.sleep(0)

        eng.sleep = record
        eng.submit(seqs)
        for r in runs:  # each run's events, up to its last
            while (await r.queue.get()).finish is None:
                pass
        tokens_so_far()
        assert eng.task is not None
        eng.task.cancel()
        return durations, sampled[1:]

    return asyncio.run(go())


def test_chunked_prefill_budget_and_step_time() -> None:
    # A (10-token prompt) and B (250-token prompt) arrive together; budget 100 per step.
    # step 1: A prefills 10, B a first chunk of 90: 100 prefill tokens, nothing decodes
    # step 2: A decodes (1 token of budget), B prefills 99: 99 ms + 10 + 2 x 1
    # step 3: A decodes, B its last 61 tokens: 61 + 12, and B samples its first token
    # then both decode (10 + 2 x 2) until A is done, then B alone (10 + 2)
    durations, sampled = _drive(_Cfg(), [(10, 6), (250, 6)])
    assert durations == [100.0, 111.0, 73.0, 14.0, 14.0, 14.0, 12.0, 12.0]
    # A samples in every step: it waits for one chunk of B's prompt at a time, not all of it
    assert sampled == [[0], [0], [0, 1], [0, 1], [0, 1], [0, 1], [1], [1]]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    cfg = _Cfg()
    cfg.max_num_seqs = 1
    durations, sampled = _drive(cfg, [(10, 2), (10, 2)])
    assert sampled == [[0], [0], [1], [1]]  # B waits until A has finished
    assert durations == [10.0, 12.0, 10.0, 12.0]


def test_scheduled_engine_answers_like_the_zero_delay_path() -> None:
    """The step loop (any delay configured) gives the same answers, chunk for chunk, as the
    bench's fast path; its steps' durations are recorded, not slept."""
    bodies = [
        (CHAT, {"messages": user("a b c"), "max_tokens": 6, "n": 2, "stream": True}),
        (CMPL, {"prompt": ["x y", "z"], "max_tokens": 5, "stop": ["e"], "stream": True}),
        (CMPL, {"prompt": "q " * 300, "max_tokens": 3, "ignore_eos": True}),
    ]

    async def answers(**cfg: Any) -> list[Any]:
        out = []
        async with sim(**cfg) as (c, engine):
            steps: list[float] = []

            async def record(seconds: float) -> None:
                steps.append(seconds)
                await asyncio.sleep(0)

            engine.engine.sleep = record
            for path, body in bodies:
                status, got = await post(c, path, body, **{"X-Request-Id": "same"})
                assert status == 200
                out.append(_strip_times(got))
            assert bool(steps) == ("prefill_ms_per_token" in cfg)
        return out

    async def go() -> None:
        fast = await answers()
        timed = await answers(prefill_ms_per_token=0.5, decode_step_ms=5, max_num_batched_tokens=64)
        assert timed == fast

    run(go)


def _strip_times(got: Any) -> Any:
    if isinstance(got, list):
        return [_strip_times(x) for x in got]
    if isinstance(got, dict):
        # the fingerprint hashes the engine's config, which differs here
        return {
            k: _strip_times(v) for k, v in got.items() if k not in ("created", "system_fingerprint")
        }
    return got


def test_zero_delay_engine_answers_without_the_step_loop() -> None:
    async def go() -> None:
        async with sim() as (c, engine):
            status, _ = await post(c, CMPL, {"prompt": "x", "max_tokens": 8, "stream": True})
            assert status == 200
            assert engine.engine.task is None  # the bench's fast path: no scheduler at all

    run(go)


def test_cli_options() -> None:
    cfg, _ = parse_args(
        ["--vllm-version", "0.33", "--max-num-batched-tokens", "512", "--max-num-seqs", "8"]
    )
    assert (cfg.vllm_version, cfg.max_num_batched_tokens, cfg.max_num_seqs) == ("0.33", 512, 8)
    cfg, _ = parse_args([])
    assert (cfg.vllm_version, cfg.max_num_batched_tokens, cfg.max_num_seqs) == ("0.31", 8192, 1024)
    with pytest.raises(SystemExit):
        parse_args(["--vllm-version", "0.11"])


def test_logprobs_in_vllms_shapes_alike_on_each_engine_of_one_weights() -> None:
    """Chat's ``content`` entries and completions' four lists (tests/real_engine/
    test_real_sim_differential.py compares the shapes with vLLM's); the figures are the
    weights' own: two engines of one weights give the same, other weights others."""
    body = {"prompt": "hi there", "max_tokens": 3, "temperature": 0, "logprobs": 2}

    async def main() -> None:
        async with sim() as (c, _), sim() as (c2, _), sim(weights_seed=7) as (other, _):
            status, a = await post(c, CMPL, body)
            assert status == 200
            lp = a["choices"][0]["logprobs"]
            assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
            assert len(lp["tokens"]) == 3
            assert "".join(lp["tokens"]) == a["choices"][0]["text"]
            assert lp["text_offset"] == [
                0,
                len(lp["tokens"][0]),
                len(lp["tokens"][0]) + len(lp["tokens"][1]),
            ]
            for tok, best, top in zip(
                lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
            ):
                assert len(top) == 2 and top[tok] == best == max(top.values()) < 0
            assert (await post(c2, CMPL, body))[1]["choices"][0]["logprobs"] == lp
            assert (await post(other, CMPL, body))[1]["choices"][0]["logprobs"] != lp
            chat = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "logprobs": True,
            }
            _, a = await post(c, CHAT, {**chat, "top_logprobs": 3})
            (first, _) = a["choices"][0]["logprobs"]["content"]
            assert list(first) == ["token", "logprob", "bytes", "top_logprobs"]
            assert (
                first["bytes"] == list(first["token"].encode()) and len(first["top_logprobs"]) == 3
            )
            _, a = await post(c, CHAT, chat)  # logprobs without top_logprobs: none listed
            assert [e["top_logprobs"] for e in a["choices"][0]["logprobs"]["content"]] == [[], []]
            _, streamed = await post(c, CHAT, {**chat, "top_logprobs": 3, "stream": True})
            entries = [ch["choices"][0]["logprobs"] for ch in streamed[1:-1] if ch["choices"]]
            # the stream's entries are the whole answer's, one per chunk
            whole = [e["token"] for e in a["choices"][0]["logprobs"]["content"]]
            assert [e["content"][0]["token"] for e in entries] == whole

    run(main)


TOOLS = [{"type": "function", "function": {"name": "f"}}]
OVER_20 = "Requested sample logprobs of 21, which is greater than max allowed: 20"
REFUSED = [
    (CHAT, {"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."
     " (parameter=top_logprobs)"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, OVER_20 + " (parameter=logprobs, value=21)"),
    (CHAT, {"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and '
     "--tool-call-parser to be set"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required"},
     'tool_choice="required" requires --tool-call-parser to be set'),
    (CHAT, {"messages": []}, P.EMPTY_CONVERSATION),
    (CMPL, {"prompt": [1, M.VOCAB_SIZE]}, f"Token id {M.VOCAB_SIZE} is out of vocabulary"),
    (CMPL, {"prompt": [], "logprobs": 21}, OVER_20 + " (parameter=logprobs, value=21)"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "message"), REFUSED)
def test_what_vllm_refuses_of_logprobs_tools_and_prompts(
    path: str, body: dict[str, Any], message: str
) -> None:
    """Each in vLLM 0.31's words (read from its CPU build's answers); the last: the logprobs
    limit comes before the empty prompt, both found at generation start."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {}

    async def main() -> None:
        async with sim() as (c, _):
            status, got = await post(c, path, {**base, "max_tokens": 2, **body})
            assert (status, got["error"]["message"], got["error"]["type"]) == (
                400,
                message,
                "BadRequestError",
            )

    run(main)


def test_logprobs_edges_as_vllm() -> None:
    """Chat ``top_logprobs: null`` with ``logprobs`` asks none (vLLM's serving requires it not
    None); a streamed chunk's ``text_offset`` is the text sent before it, a stop string's
    held-back characters not counted (completion/serving.py ``previous_text_lens``)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}

    async def main() -> None:
        async with sim() as (c, _):
            _, a = await post(c, CHAT, {**chat, "top_logprobs": None})
            assert a["choices"][0]["logprobs"] is None
            whole = (await post(c, CMPL, {"prompt": "hi", "max_tokens": 6, "ignore_eos": True}))[1]
            text = whole["choices"][0]["text"]
            stop = text.split()[2]  # the third word: held back while it may be starting
            body = {"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "stream": True}
            _, chunks = await post(c, CMPL, {**body, "logprobs": 1, "stop": [stop]})
            sent = 0
            for ch in chunks[:-1]:
                (choice,) = ch["choices"]
                assert choice["logprobs"]["text_offset"] == [sent]
                sent += len(choice["text"])

    run(main)


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        # the stream and beam search check comes before the model's (completion/serving.py)
        (CMPL, {"model": "nope", "prompt": "hi", "use_beam_search": True, "stream": True},
         400, "Streaming is not currently supported with beam search"),
        (CHAT, {"tools": 5, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         400, "The tool specified in `tool_choice` does not match any of the specified `tools`"
         " (parameter=tool_choice)"),
        (CHAT, {"messages": [{"role": "user", "content": [{"image_url": {"url": "x"}}]}]},
         400, f"{MODEL} is not a multimodal model"),
    ],
)  # fmt: skip
def test_what_vllm_refuses_before_generating(
    path: str, body: dict[str, Any], status: int, message: str
) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {}

    async def main() -> None:
        async with sim() as (c, _):
            got_status, got = await post(c, path, {**base, "max_tokens": 2, **body})
            assert (got_status, got["error"]["message"]) == (status, message)

    run(main)
