"""The router's OpenAI/vLLM surface end to end (issue 14), over real simulated engines (vLLM
0.31.0's shapes, ``pd_router_dev.sim``): /v1/models and /v1/models/{id} taken from the engines,
405 with ``Allow``, one answer shape whatever the route (an LMCache-split answer equals a direct
one field for field, streamed or not), fresh completion ids, ``n > 1``/batch requests and
vLLM's other endpoints counted, reasoning models served directly on the LMCache route."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack, free_port
from router_testlib import (
    MODEL,
    LMCacheStack,
    client,
    http_call,
    long_text,
    metric_value,
    wait_until,
)

KEY = "surface-key"
DEC_HOST = "127.0.0.2"


class Surface:
    """One LMCache stack (a prefiller, two decoders) and four routers over it: ``split`` (the
    stack's own: long prompts are split), ``direct`` (threshold never reached: the same
    requests served by one decoder), ``reasoning`` (model.reasoningParser set, API keys on)
    and ``alone`` (no engine reachable)."""

    def __init__(self, stack: Stack) -> None:
        self.s = s = LMCacheStack(stack, name="surf")
        keys = stack.workdir / "surface-keys"
        keys.write_text(KEY + "\n")

        def router(name: str, over: dict[str, Any]) -> Proc:
            # routers that expect no notification bind a port of their own
            return s.router(name, {**over, "lmcache": {"notifyPort": free_port()}})

        self.split = s.router("surf-split")
        self.direct = router("surf-direct", {"routing": {"threshold": 1_000_000}})
        self.reasoning = router(
            "surf-reasoning",
            {"model": {"reasoningParser": "qwen3"}, "auth": {"apiKeysFile": str(keys)}},
        )
        dead = [f"http://127.0.0.1:{free_port()}"]
        self.alone = router(
            "surf-alone",
            {"pools": {"decode": {"static": dead}, "prefill": {"static": dead}}},
        )
        for r in (self.split, self.direct, self.reasoning):
            wait_until(
                lambda r=r: metric_value(r.url(), "pd_router_healthy_endpoints") == 3,
                f"{r.name} sees every engine",
            )
        self.engine = s.decoders[0].url(DEC_HOST)


@pytest.fixture(scope="module")
def sf(stack: Stack) -> Iterator[Surface]:
    yield Surface(stack)


def _call(
    base: str, path: str, body: dict[str, Any] | None = None, method: str = "POST", **hdrs: str
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", **hdrs} if body is not None else hdrs
    data = json.dumps(body).encode() if body is not None else None
    return http_call(base + path, method, data, headers)


def _events(data: bytes) -> list[Any]:
    out = []
    for ev in data.split(b"\n\n"):
        if ev.startswith(b"data: ") and ev != b"data: [DONE]":
            out.append(json.loads(ev[6:]))
    assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
    return out


def _without(obj: Any, keys: tuple[str, ...] = ("id", "created")) -> Any:
    if isinstance(obj, dict):
        return {k: _without(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_without(v, keys) for v in obj]
    return obj


def _shape(obj: Any) -> Any:
    """The keys of a JSON value, recursively (lists by their items' shapes)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return None


def _body(chat: bool, stream: bool, prompt: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
    return body


def _answer(base: str, chat: bool, body: dict[str, Any], **hdrs: str) -> tuple[str, Any]:
    """(x-pd-route, parsed answer: the JSON body or the list of SSE chunks)."""
    status, h, data = _call(
        base, "/v1/chat/completions" if chat else "/v1/completions", body, **hdrs
    )
    assert status == 200, data[:500]
    return h.get("x-pd-route", ""), (_events(data) if body.get("stream") else json.loads(data))


# ---------------------------------------------------------------------- one answer shape
OPTIONS = {
    "plain": {},
    "usage": {"stream_options": {"include_usage": True}},
    "continuous": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "one-token": {"max_tokens": 1},
    "one-token-usage": {"max_tokens": 1, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("opt", sorted(OPTIONS))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_an_lmcache_answer_equals_the_direct_one(
    sf: Surface, chat: bool, stream: bool, opt: str
) -> None:
    """The same request, split by the LMCache route and served by one decoder: the same
    fields with the same values (ids and ``created`` aside), chunk for chunk when streamed,
    and the same as the engine's own answer."""
    extra = dict(OPTIONS[opt])
    if not stream and "stream_options" in extra:
        extra.pop("stream_options")  # vLLM refuses stream_options without stream
    body = _body(chat, stream, long_text(300 + len(opt)), **extra)
    route, split = _answer(sf.split.url(), chat, body)
    assert route == "disaggregated"
    route, direct = _answer(sf.direct.url(), chat, body)
    assert route == "direct"
    _, engine = _answer(sf.engine, chat, body)
    assert _shape(split) == _shape(direct)
    assert _without(split) == _without(direct) == _without(engine)
    if stream and chat:
        assert split[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if not stream and chat:
        assert "tool_calls" not in split["choices"][0]["message"]  # vLLM drops it when empty
        assert split["choices"][0]["message"]["reasoning"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stop_string_gives_the_same_stop_reason(sf: Surface, chat: bool, stream: bool) -> None:
    """A stop string: the same answer and ``stop_reason``. Streamed, the text is cut into
    chunks differently: vLLM holds back output that may start a stop string, and the
    prefill leg, finished after its one token, holds back nothing (docs/router.md)."""
    prompt = long_text(310)
    _, plain = _answer(sf.engine, chat, _body(chat, False, prompt))
    words = plain["choices"][0]["message"]["content"] if chat else plain["choices"][0]["text"]
    stop = words.split()[3]
    body = _body(chat, stream, prompt, stop=[stop])
    route, split = _answer(sf.split.url(), chat, body)
    assert route == "disaggregated"
    _, direct = _answer(sf.direct.url(), chat, body)
    if stream:

        def text(chunks: list[Any]) -> str:
            return "".join(
                (c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"])
                for c in chunks
                if c["choices"]
            )

        assert text(split) == text(direct)
        assert {json.dumps(_shape(c)) for c in split} == {json.dumps(_shape(c)) for c in direct}
        assert _without(split[-1]) == _without(direct[-1])
    else:
        assert _without(split) == _without(direct)
    last = split[-1] if stream else split
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_split_answers_have_fresh_ids_in_vllms_format(
    sf: Surface, chat: bool, stream: bool
) -> None:
    rid = "client-" + uuid.uuid4().hex
    ids = set()
    for _ in range(2):
        body = _body(chat, stream, long_text(320))
        route, got = _answer(sf.split.url(), chat, body, **{"X-Request-Id": rid})
        assert route == "disaggregated"
        chunk_ids = {c["id"] for c in got} if stream else {got["id"]}
        assert len(chunk_ids) == 1
        (cid,) = chunk_ids
        assert re.fullmatch(("chatcmpl-" if chat else "cmpl-") + "[0-9a-f]{16}", cid), cid
        ids.add(cid)
    assert len(ids) == 2


def test_the_openai_client_reads_a_split_stream(sf: Surface) -> None:
    with client(sf.split).chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": long_text(330)}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    ) as resp:
        assert resp.headers["x-pd-route"] == "disaggregated"
        chunks = list(resp.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert [c.usage.completion_tokens for c in chunks] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert chunks[-2].choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- n > 1, batches
def test_several_sequences_are_served_directly_and_counted(sf: Surface) -> None:
    base = sf.split.url()
    n_before = metric_value(base, "pd_router_batch_requests_total", {"reason": "n"})
    p_before = metric_value(base, "pd_router_batch_requests_total", {"reason": "prompts"})
    route, got = _answer(base, True, _body(True, False, long_text(300), n=2))
    assert route == "direct" and len(got["choices"]) == 2
    body = {**_body(False, False, ""), "prompt": [long_text(300), long_text(301)]}
    route, got = _answer(base, False, body)
    assert route == "direct" and len(got["choices"]) == 2
    assert metric_value(base, "pd_router_batch_requests_total", {"reason": "n"}) == n_before + 1
    after = metric_value(base, "pd_router_batch_requests_total", {"reason": "prompts"})
    assert after == p_before + 1


def test_batch_and_passthrough_counters_start_at_zero(sf: Surface) -> None:
    text = http_call(sf.alone.url() + "/metrics")[2].decode()
    for reason in ("n", "prompts"):
        assert f'pd_router_batch_requests_total{{reason="{reason}"}} 0.0' in text
    for path in ("/v1/responses", "/tokenize", "/v1/embeddings", "/v1/audio/transcriptions"):
        assert f'pd_router_passthrough_requests_total{{endpoint="{path}"}} 0.0' in text
    assert 'pd_router_fallbacks_total{reason="reasoning_parser"} 0.0' in text


# ---------------------------------------------------------------------- reasoning models
def test_a_reasoning_models_chat_is_served_directly_on_the_lmcache_route(sf: Surface) -> None:
    base, auth = sf.reasoning.url(), {"Authorization": f"Bearer {KEY}"}
    labels = {"reason": "reasoning_parser"}
    before = metric_value(base, "pd_router_fallbacks_total", labels)
    route, got = _answer(base, True, _body(True, False, long_text(300)), **auth)
    assert route == "fallback" and got["choices"][0]["message"]["content"]
    assert metric_value(base, "pd_router_fallbacks_total", labels) == before + 1
    route, _ = _answer(base, True, _body(True, False, "short"), **auth)
    assert route == "direct"  # short prompts are never split anyway: not a fallback
    assert metric_value(base, "pd_router_fallbacks_total", labels) == before + 1


# ---------------------------------------------------------------------- /v1/models
def test_models_are_the_engines_cards(sf: Surface) -> None:
    status, h, data = _call(sf.split.url(), "/v1/models", method="GET")
    assert status == 200 and h["x-pd-models-source"] == "engine"
    got = json.loads(data)
    _, _, own = _call(sf.engine, "/v1/models", method="GET")
    engine = json.loads(own)
    # the router's one addition: the healthy engines by KV revision (these name none: "")
    assert [c.pop("kv_revisions") for c in got["data"]] == [{"prefill": {"": 1}, "decode": {"": 2}}]
    assert _shape(got) == _shape(engine)
    assert _without(got, ("created", "id")) == _without(engine, ("created", "id"))
    (card,) = got["data"]
    assert card["id"] == MODEL and card["max_model_len"] == 32768 and card["created"] > 0
    assert card["owned_by"] == "vllm" and card["root"] == MODEL
    models = client(sf.split).models.list()
    assert [m.id for m in models.data] == [MODEL]
    one = client(sf.split).models.retrieve(MODEL)
    assert one.id == MODEL and one.model_extra["max_model_len"] == 32768


def test_an_unknown_model_id_is_vllms_404(sf: Surface) -> None:
    status, h, data = _call(sf.split.url(), "/v1/models/no-such/model", method="GET")
    assert status == 404 and h["content-type"].startswith("application/json")
    assert json.loads(data) == {
        "error": {
            "message": "The model `no-such/model` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    # the same body as vLLM's for a completion naming that model
    _, _, engine = _call(
        sf.engine, "/v1/completions", {"model": "no-such/model", "prompt": "x", "max_tokens": 1}
    )
    assert json.loads(engine) == json.loads(data)


def test_models_without_an_engine_are_the_routers_own_card(sf: Surface) -> None:
    status, h, data = _call(sf.alone.url(), "/v1/models", method="GET")
    assert status == 200 and h["x-pd-models-source"] == "router"
    (card,) = json.loads(data)["data"]
    _, _, own = _call(sf.engine, "/v1/models", method="GET")
    # vLLM's ModelCard fields, and the router's kv_revisions
    assert set(card) == {*json.loads(own)["data"][0], "kv_revisions"}
    assert card["id"] == MODEL and card["max_model_len"] is None
    status, _, data = _call(sf.alone.url(), f"/v1/models/{MODEL}", method="GET")
    assert status == 200 and json.loads(data)["id"] == MODEL


def test_models_need_the_api_key_when_keys_are_set(sf: Surface) -> None:
    base = sf.reasoning.url()
    for path in ("/v1/models", f"/v1/models/{MODEL}"):
        assert _call(base, path, method="GET")[0] == 401
        status, _, data = _call(base, path, method="GET", Authorization=f"Bearer {KEY}")
        assert status == 200, data


# ---------------------------------------------------------------------- 405 / 404
@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("GET", "/tokenize", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("POST", f"/v1/models/{MODEL}", "GET, HEAD"),
        ("POST", "/health", "GET, HEAD"),
    ],
)
def test_a_known_path_under_another_method_is_405_with_allow(
    sf: Surface, method: str, path: str, allow: str
) -> None:
    status, h, data = http_call(sf.split.url() + path, method)
    assert status == 405 and h["allow"] == allow, (status, h, data)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 405
    # vLLM answers the same status and Allow (FastAPI's {"detail": ...} body)
    if path not in ("/health", f"/v1/models/{MODEL}"):
        estatus, eh, edata = http_call(sf.engine + path, method)
        assert estatus == 405 and eh["allow"].replace(", HEAD", "") == allow.replace(", HEAD", "")
        assert json.loads(edata) == {"detail": "Method Not Allowed"}


@pytest.mark.parametrize(
    "path", ["/nope", "/v1/completion", "/v1/responses/resp_1", "/v1/realtime"]
)
def test_an_unknown_path_stays_404(sf: Surface, path: str) -> None:
    for method in ("GET", "POST"):
        status, h, data = http_call(sf.split.url() + path, method, b"{}")
        assert status == 404 and "allow" not in h, (method, path, status)
        assert json.loads(data)["error"]["code"] == 404


# ---------------------------------------------------------------------- other endpoints
def test_tokenize_and_detokenize_are_relayed_to_a_decoder(sf: Surface) -> None:
    base = sf.split.url()
    labels = {"endpoint": "/tokenize"}
    before = metric_value(base, "pd_router_passthrough_requests_total", labels)
    req = {"model": MODEL, "prompt": "hello there router"}
    rid = "tok-" + uuid.uuid4().hex
    status, h, data = _call(base, "/tokenize", req, **{"X-Request-Id": rid})
    assert status == 200 and h["x-pd-route"] == "direct" and h["x-request-id"] == rid
    _, _, engine = _call(sf.engine, "/tokenize", req)
    assert data == engine  # the engine's bytes
    assert metric_value(base, "pd_router_passthrough_requests_total", labels) == before + 1
    tokens = json.loads(data)["tokens"]
    status, _, data = _call(base, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert status == 200 and data == _call(sf.engine, "/detokenize", {"tokens": tokens})[2]
    # the engine's own 4xx, as it sent it
    status, _, data = _call(base, "/detokenize", {"model": "other", "tokens": [1]})
    assert status == 404 and json.loads(data)["error"]["type"] == "NotFoundError"


def test_an_endpoint_the_engine_lacks_gets_the_engines_404(sf: Surface) -> None:
    status, h, data = _call(sf.split.url(), "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and h["x-pd-route"] == "direct"
    assert json.loads(data) == {"detail": "Not Found"}  # vLLM's (FastAPI's) own answer


def test_other_endpoints_need_the_api_key_and_a_parsable_json_body(sf: Surface) -> None:
    base = sf.reasoning.url()
    req = {"model": MODEL, "prompt": "hi"}
    assert _call(base, "/tokenize", req)[0] == 401
    assert _call(base, "/tokenize", req, Authorization=f"Bearer {KEY}")[0] == 200
    status, _, data = http_call(
        base + "/tokenize",
        "POST",
        b'{"prompt": NaN}',
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    assert status == 400 and "malformed JSON" in json.loads(data)["error"]["message"]
