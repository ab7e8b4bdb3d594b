"""The OpenAI/vLLM surface without processes (issue 14): vLLM's other endpoints relayed by the
direct route, what the app does to their bodies, the LMCache route's answer shapes and the
fields it serves directly, the counters of batches and relayed endpoints."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from fakes import AsApp, FakeDownstream, FakeResponse, FakeWaiter, World, ctx

from pd_router import balancing, http1, metrics
from pd_router.app import Router
from pd_router.config import LMCache, parse_config
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.lmcache import LMCacheRoute
from pd_router.handoff.lmcache_answer import new_completion_id, relabel_chunk, whole_answer
from pd_router.openai_wire import (
    PASSTHROUGH_PATHS,
    batch_reason,
    model_card,
    served_cards,
    stream_opening,
)
from pd_router.request import Ctx

P1, D1, D2 = 9001, 9101, 9102
IDS = [11, 12, 13, 14]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---------------------------------------------------------------------- relayed endpoints
def test_a_relayed_stream_is_forwarded_byte_for_byte() -> None:
    w = World()
    sse = [b'event: response.created\ndata: {"a":1}\n\n', b'data: {"b":2}\n\n']
    w.up.on(D1, "/v1/responses", FakeResponse(200, chunks=sse, ctype="text/event-stream"))
    down = FakeDownstream()
    c = ctx({"input": "hi", "stream": True}, path="/v1/responses")
    run(w.direct().passthrough(c, down))
    assert b"".join(down.events) == b"".join(sse) and down.ended
    assert down.headers["Content-Type"] == "text/event-stream"
    assert down.headers["x-pd-route"] == "direct" and down.headers["x-request-id"] == "rid1"
    assert w.up.calls_to("/v1/responses") == [(D1, {"input": "hi", "stream": True})]
    assert w.sample("pd_router_requests_total", route="direct", outcome="ok") == 1
    assert w.load() == [(0, 0)] * 2


def test_a_relayed_answer_is_retried_elsewhere_on_a_5xx_and_passed_on_as_is() -> None:
    w = World(decode=(D1, D2))
    body = b'{"count":2,"max_model_len":9,"tokens":[1,2],"token_strs":null}'
    first = balancing.pick(w.decode.healthy, balancing.decode_load, "k")
    assert first is not None
    other = D2 if first.port == D1 else D1
    w.up.on(first.port, "/tokenize", FakeResponse(503, b"{}"))
    w.up.on(other, "/tokenize", FakeResponse(200, body))
    down = FakeDownstream()
    c = ctx({"prompt": "x"}, path="/tokenize")
    c.affinity = "k"
    run(w.direct().passthrough(c, down))
    assert down.status == 200 and down.body == body
    assert w.sample("pd_router_retries_total", pool="decode") == 1
    assert w.load() == [(0, 0)] * 3


def _router(**over: Any) -> Router:
    cfg = parse_config(
        {
            "routing": {"connector": "nixl"},
            "pools": {
                "prefill": {"discovery": "static", "static": ["http://127.0.0.1:9"]},
                "decode": {"discovery": "static", "static": ["http://127.0.0.1:9"]},
            },
            **over,
        }
    )
    return Router(cfg, metrics.Metrics())


def _parse(router: Router, body: bytes, ctype: str | None, path: str = "/v1/responses") -> Any:
    headers = {"content-type": ctype} if ctype is not None else {}
    req = http1.Request(SimpleNamespace(peer="127.0.0.1"), "POST", path.encode(), headers)  # type: ignore[arg-type]
    c = Ctx("rid9", False, path)
    return c, router._parse_passthrough(req, c, body)


def test_a_relayed_json_body_goes_unchanged_unless_it_steers_the_handoff() -> None:
    r = _router()
    raw = b'{"input": "hi",  "stream": true}'
    c, bad = _parse(r, raw, "application/json")
    assert bad is None and c.raw is raw and c.stream is True
    assert c.headers == b"Content-Type: application/json\r\nX-Request-Id: rid9\r\n"
    evil = b'{"input": "hi", "kv_transfer_params": {"do_remote_prefill": true},'
    evil += b' "vllm_xargs": {"kv_transfer_params": {}, "keep": 1}}'
    c, bad = _parse(r, evil, "application/json; charset=utf-8")
    assert bad is None and orjson.loads(c.raw) == {"input": "hi", "vllm_xargs": {"keep": 1}}


@pytest.mark.parametrize(
    ("raw", "ctype", "status"),
    [
        (b'{"input": NaN}', "application/json", 400),  # orjson refuses what Python reads
        (b"[" * 200 + b"]" * 200, "application/json", 400),
        (b"{}", "application/json\x7f", 400),
    ],
)
def test_a_relayed_body_the_router_cannot_vouch_for_is_refused(
    raw: bytes, ctype: str, status: int
) -> None:
    _, bad = _parse(_router(), raw, ctype)
    assert bad is not None and bad.status == status


def test_a_multipart_body_keeps_its_content_type_and_bytes() -> None:
    ctype = "multipart/form-data; boundary=xyz"
    raw = b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--xyz--\r\n'
    c, bad = _parse(_router(), raw, ctype, "/v1/audio/transcriptions")
    assert bad is None and c.raw is raw and not c.stream
    assert c.headers == b"Content-Type: " + ctype.encode() + b"\r\nX-Request-Id: rid9\r\n"
    c, bad = _parse(_router(), b"{}", None, "/tokenize")  # none sent: none relayed
    assert bad is None and c.headers == b"X-Request-Id: rid9\r\n"


def test_the_relayed_paths_are_routes_and_counters() -> None:
    from pd_router.app import build_server

    routes = build_server(_router()).routes
    posts = {path for path, methods in routes._exact.items() if "POST" in methods}
    assert set(PASSTHROUGH_PATHS) <= posts
    assert len(set(PASSTHROUGH_PATHS)) == len(PASSTHROUGH_PATHS)
    assert not {"/v1/completions", "/v1/chat/completions"} & set(PASSTHROUGH_PATHS)
    text = metrics.Metrics().render().decode()
    for path in PASSTHROUGH_PATHS:
        assert f'pd_router_passthrough_requests_total{{endpoint="{path}"}} 0.0' in text


# ---------------------------------------------------------------------- batches, models
@pytest.mark.parametrize(
    ("body", "chat", "reason"),
    [
        ({"prompt": "x"}, False, None),
        ({"prompt": "x", "n": 1}, False, None),
        ({"prompt": "x", "n": 3}, False, "n"),
        ({"messages": [], "n": 2}, True, "n"),
        ({"prompt": ["a", "b"]}, False, "prompts"),
        ({"prompt": [[1], [2]]}, False, "prompts"),
        ({"prompt": [1, 2, 3]}, False, None),  # one prompt of token ids
        ({"prompt": ["a"]}, False, None),
    ],
)
def test_batch_reasons(body: dict[str, Any], chat: bool, reason: str | None) -> None:
    assert batch_reason(body, chat) == reason
    assert reason is None or reason in metrics.BATCH_REASONS


def test_only_the_served_models_cards_are_listed() -> None:
    base = {"id": "m", "object": "model", "max_model_len": 8}
    lora = {"id": "m-lora", "object": "model", "parent": "m"}
    assert served_cards({"object": "list", "data": [base, lora]}, "m") == [base]
    for junk in (None, [], {"data": None}, {"data": [1, "m"]}):
        assert served_cards(junk, "m") == []
    card = model_card("m", None, 5)
    assert set(card) == {
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"
    }  # fmt: skip


# ---------------------------------------------------------------------- LMCache shapes
def test_fresh_ids_in_vllms_format() -> None:
    ids = {new_completion_id(True) for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("chatcmpl-") and len(i) == 25 for i in ids)
    assert new_completion_id(False).startswith("cmpl-")


def _leg(text: str = "BCD", **choice: Any) -> dict[str, Any]:
    """A vLLM 0.31 ``text_completion`` answer, every field as model_dump writes it."""
    return {
        "id": "cmpl-engine",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
                **choice,
            }
        ],
        "service_tier": None,
        "system_fingerprint": "vllm-0.31.0-abc",
        "usage": {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3},
        "kv_transfer_params": {"first_tok": 3},
        "ec_transfer_params": None,
        "metrics": None,
    }


def test_a_whole_chat_answer_has_vllms_fields() -> None:
    out = whole_answer(True, "chatcmpl-x", "m", _leg(stop_reason="\n"), "ABCD", {"u": 1})
    # ChatCompletionResponse / ChatCompletionResponseChoice / ChatMessage (vLLM 0.31.0)
    assert list(out) == [
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
        "ec_transfer_params", "metrics",
    ]  # fmt: skip
    (choice,) = out["choices"]
    assert list(choice) == [
        "index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "routed_experts",
    ]  # fmt: skip
    assert choice["message"] == {
        "role": "assistant", "content": "ABCD", "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "reasoning": None,
    }  # fmt: skip
    assert choice["stop_reason"] == "\n" and out["kv_transfer_params"] is None
    assert out["system_fingerprint"] == "vllm-0.31.0-abc" and out["usage"] == {"u": 1}


def test_a_whole_completion_keeps_every_field_of_the_leg() -> None:
    leg = _leg()
    out = whole_answer(False, "cmpl-x", "m", leg, "ABCD", {"u": 1})
    assert list(out) == list(leg) and list(out["choices"][0]) == list(leg["choices"][0])
    assert out["id"] == "cmpl-x" and out["choices"][0]["text"] == "ABCD"
    assert out["kv_transfer_params"] is None and leg["kv_transfer_params"] == {"first_tok": 3}


def test_relabelled_chunks() -> None:
    chunk = {
        "id": "cmpl-e",
        "object": "text_completion",
        "created": 9,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "B",
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": "x",
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
        "system_fingerprint": "fp",
        "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2},
    }
    chat = relabel_chunk(chunk, True, "chatcmpl-s", 1, "m")
    assert chat == {
        "id": "chatcmpl-s",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "B"},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": "x",
                "token_ids": None,
            }
        ],
        "system_fingerprint": "fp",
        "usage": {
            "prompt_tokens": 4,
            "total_tokens": 7,
            "completion_tokens": 3,
            "completion_tokens_details": None,
        },
    }
    comp = relabel_chunk(chunk, False, "cmpl-s", 1, "m")
    assert comp["choices"] == chunk["choices"] and comp["id"] == "cmpl-s"
    assert comp["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    err = {"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}}
    assert relabel_chunk(err, True, "chatcmpl-s", 1, "m") is err  # as the engine sent it


def _prefill(text: str = "A", finish: str | None = "length") -> FakeResponse:
    leg = _leg(text, finish_reason=finish)
    leg["usage"] = {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}
    leg["kv_transfer_params"] = {"first_tok": 99}
    return FakeResponse(200, leg)


def _lmcache(w: World, waiter: FakeWaiter, reasoning: bool = False) -> AsApp:
    lm = LMCache(decoder_init_ports=[7300], decoder_alloc_ports=[7400])
    d = DirectRoute(w.legs)
    return AsApp(w, LMCacheRoute(lm, w.legs, d, waiter, reasoning), d)


def _lm_ctx(body: dict[str, Any], chat: bool = False) -> Ctx:
    c = ctx({"max_tokens": 8, **body}, chat=chat)
    c.ids = IDS
    return c


def test_a_split_chat_stream_opens_with_the_role_chunk_and_counts_usage() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", _prefill())
    leg = b"".join(
        b"data: " + orjson.dumps(c) + b"\n\n"
        for c in (
            {"id": "e", "object": "text_completion", "created": 2, "model": "m",
             "choices": [{"index": 0, "text": "B", "logprobs": None, "finish_reason": "length",
                          "stop_reason": None, "prompt_token_ids": None, "token_ids": None}],
             "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1}},
            {"id": "e", "object": "text_completion", "created": 2, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1},
             "system_fingerprint": "fp"},
        )
    ) + b"data: [DONE]\n\n"  # fmt: skip
    w.up.on(D1, "/v1/completions", FakeResponse(200, chunks=[leg], ctype="text/event-stream"))
    down = FakeDownstream()
    so = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": [{"role": "user", "content": "q"}], "stream": True, "stream_options": so}
    run(_lmcache(w, waiter).serve(_lm_ctx(body, chat=True), down))
    chunks = down.sse()
    role, first, last_token, usage = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] is None and role["prompt_text"] is None
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 2]
    assert [c["usage"]["prompt_tokens"] for c in chunks] == [4, 4, 4, 4]
    assert first["choices"][0] == {
        "index": 0,
        "delta": {"content": "A"},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": None,
    }
    assert last_token["choices"][0]["stop_reason"] is None
    assert usage["choices"] == [] and usage["system_fingerprint"] == "fp"
    assert "completion_tokens_details" not in usage["usage"]
    assert len({c["id"] for c in chunks}) == 1 and {c["created"] for c in chunks} == {
        role["created"]
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_first_token_answer_is_built_on_the_prefill_legs(stream: bool) -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", _prefill("!", "stop"))
    down = FakeDownstream()
    run(_lmcache(w, waiter).serve(_lm_ctx({"prompt": "q", "stream": stream}), down))
    if stream:
        (only,) = down.sse()
        assert only["choices"][0]["finish_reason"] == "stop"
        assert only["system_fingerprint"] == "vllm-0.31.0-abc"  # no usage chunk follows
        assert set(only["choices"][0]) == {
            "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
            "token_ids",
        }  # fmt: skip
    else:
        body = down.json()
        assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}
        assert body["kv_transfer_params"] is None and body["choices"][0]["text"] == "!"
        assert body["system_fingerprint"] == "vllm-0.31.0-abc"
    assert len(w.up.calls) == 1 and w.load() == [(0, 0)] * 2


def test_a_reasoning_models_chat_is_served_directly_its_completions_still_split() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(D1, "/v1/chat/completions", FakeResponse(200, b'{"choices":[]}'))
    down = FakeDownstream()
    chat = _lm_ctx({"messages": [{"role": "user", "content": "q"}]}, chat=True)
    run(_lmcache(w, waiter, reasoning=True).serve(chat, down))
    assert down.headers["x-pd-route"] == "fallback" and not waiter.expected
    assert w.sample("pd_router_fallbacks_total", reason="reasoning_parser") == 1
    w.up.on(P1, "/v1/completions", _prefill())
    w.up.on(D1, "/v1/completions", FakeResponse(200, _leg()))
    down = FakeDownstream()
    run(_lmcache(w, waiter, reasoning=True).serve(_lm_ctx({"prompt": "q"}), down))
    assert down.headers["x-pd-route"] == "disaggregated"
    assert down.json()["choices"][0]["text"] == "ABCD"


@pytest.mark.parametrize(
    ("field", "value", "split"),
    [
        ("return_token_ids", True, False),
        ("return_token_ids", False, True),
        ("use_beam_search", True, False),
        ("use_beam_search", False, True),
        ("truncate_prompt_tokens", 100, False),
        ("thinking_token_budget", 10, False),
        ("repetition_detection", {"max_pattern_size": 4}, False),
        ("return_prompt_text", True, False),
    ],
)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_fields_a_split_cannot_honour_are_served_directly(
    field: str, value: Any, split: bool, chat: bool
) -> None:
    w, waiter = World(), FakeWaiter("ok")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    w.up.on(P1, "/v1/completions", _prefill())
    w.up.on(D1, "/v1/completions", FakeResponse(200, _leg()))
    w.up.on(D1, path, FakeResponse(200, b"{}"))
    body: dict[str, Any] = {field: value}
    body.update({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"})
    down = FakeDownstream()
    run(_lmcache(w, waiter).serve(_lm_ctx(body, chat=chat), down))
    assert down.headers["x-pd-route"] == ("disaggregated" if split else "fallback")
    if not split:
        assert w.sample("pd_router_fallbacks_total", reason="unsupported_fields") == 1


# ---------------------------------------------------------------------- a stream's opening
ROLE = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n'
)


@pytest.mark.parametrize(
    ("head", "opening"),
    [
        (b"", "more"),
        (ROLE, "more"),  # vLLM's role chunk: no token yet
        (ROLE[:-2], "more"),  # an event not complete yet
        (ROLE + b": keep-alive\n\n", "more"),
        (ROLE + b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n', "more"),
        (ROLE + b"data: [DONE]\n\n", "empty"),  # a failed KV load in vLLM 0.31
        (b"data: [DONE]\n\n", "empty"),
        (
            ROLE
            + b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
            "began",
        ),
        (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n', "began"),
        (b'data: {"choices":[{"index":0,"delta":{"reasoning":"hm"}}]}\n\n', "began"),
        (b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n', "began"),
        (b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n', "began"),
        (b'data: {"error":{"message":"x","code":400}}\n\n', "began"),  # relayed as it is
        (b"data: not json\n\n", "began"),
        (b"data: {}\n\n", "began"),  # a shape the router does not read: relayed
    ],
)
def test_a_stream_has_begun_once_a_token_a_finish_or_an_error_came(
    head: bytes, opening: str
) -> None:
    assert stream_opening(head) == opening
