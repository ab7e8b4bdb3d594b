"""NIXL mode end to end, failure handling (section 7 of the issue) and the HTTP surface."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pd_router import balancing
from pd_router.discovery import Endpoint
from pd_router.handoff import nixl as handoff_nixl
from pd_router_dev.devstack import Proc, Stack, free_port
from router_testlib import (
    MODEL,
    answer,
    chat_with_client_kv,
    client,
    http_call,
    long_text,
    metric_value,
    post_json,
    post_raw_headers,
    set_fault,
    wait_until,
    write_config,
)


class Nixl:
    def __init__(self, stack: Stack, name: str = "nx") -> None:
        self.stack = stack
        self.prefill = stack.sim(f"{name}-prefill", "--kv-connector", "nixl")
        self.decoders = [stack.sim(f"{name}-decode{i}", "--kv-connector", "nixl") for i in range(2)]

    def router(
        self,
        name: str,
        over: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        decoders: list[str] | None = None,
    ) -> Proc:
        cfg: dict[str, Any] = {
            "routing": {
                "connector": "nixl",
                "threshold": 256,
                "decision": "length",
            },  # the hand-off under test, not the decision (test_router_decision.py)
            "pools": {
                "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                "decode": {
                    "discovery": "static",
                    "static": decoders or [d.url() for d in self.decoders],
                },
            },
            "timeouts": {"prefillSeconds": 3, "firstByteSeconds": 3, "streamIdleSeconds": 5},
        }
        for k, v in (over or {}).items():
            cfg[k] = {**cfg.get(k, {}), **v}
        return self.stack.router(name, write_config(self.stack.workdir, name, cfg), env)


@pytest.fixture(scope="module")
def nx(stack: Stack) -> Iterator[Nixl]:
    n = Nixl(stack)
    yield n


@pytest.fixture(scope="module")
def router(nx: Nixl) -> Proc:
    return nx.router("nx-router")


@pytest.fixture(autouse=True)
def _reset_faults(nx: Nixl) -> Iterator[None]:
    yield
    for e in (nx.prefill, *nx.decoders):
        set_fault(e, "none")
        http_call(e.url() + "/sim/release", "POST")


def _direct(engine: Proc, text: str, n: int = 10) -> str:
    status, body, _ = post_json(
        engine.url() + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": text}], "max_tokens": n, "ignore_eos": True},
    )
    assert status == 200
    return body["choices"][0]["message"]["content"]


def _chat(router: Proc, text: str, **kw: Any) -> tuple[str, str]:
    raw = client(router).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=10,
        extra_body={"ignore_eos": True},
        **kw,
    )
    return raw.parse().choices[0].message.content, raw.headers["x-pd-route"]


def test_routes_and_equal_answers(nx: Nixl, router: Proc) -> None:
    for text, route in (("short one", "direct"), (long_text(), "disaggregated")):
        answer, got = _chat(router, text)
        assert got == route
        assert answer == _direct(nx.decoders[0], text)
    assert (
        metric_value(nx.decoders[0].url(), "pd_sim_kv_remote_prefill_total")
        + metric_value(nx.decoders[1].url(), "pd_sim_kv_remote_prefill_total")
        >= 1
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_min_tokens_up_to_max_tokens_is_served(
    nx: Nixl, router: Proc, stream: bool, chat: bool
) -> None:
    """The prefill leg generates one token: it must not carry the client's min_tokens
    (vLLM refuses min_tokens > max_tokens with a 400)."""
    prompt = long_text(300)
    extra = {"max_tokens": 6, "min_tokens": 6}
    direct = answer(nx.decoders[0].url(), chat, prompt, stream, **extra)
    split = answer(router.url(), chat, prompt, stream, **extra)
    assert split[2] == "disaggregated"
    assert split[:2] == direct[:2] and direct[1] == 6


def test_the_simulated_engine_refuses_min_tokens_above_max_tokens_like_vllm(nx: Nixl) -> None:
    body = {"prompt": "x", "max_tokens": 6, "min_tokens": 7}
    status, got, _ = post_json(nx.decoders[0].url() + "/v1/completions", body)
    assert status == 400
    # vLLM's nested error body (SamplingParams._verify_args, vLLM 0.31)
    msg = "min_tokens must be less than or equal to max_tokens=6, got 7."
    assert got["error"]["message"] == msg
    assert got["error"]["type"] == "BadRequestError" and got["error"]["code"] == 400


def test_min_tokens_above_max_tokens_is_not_prefilled(nx: Nixl, router: Proc) -> None:
    body = {"prompt": long_text(300), "max_tokens": 1, "min_tokens": 3}
    http_call(nx.prefill.url() + "/sim/requests?clear=1")
    direct = post_json(nx.decoders[0].url() + "/v1/completions", body)
    got = post_json(router.url() + "/v1/completions", body)
    assert got[0] == direct[0] == 400 and got[1] == direct[1]
    assert json.loads(http_call(nx.prefill.url() + "/sim/requests")[2]) == []


def test_threshold_zero_always_disaggregated(nx: Nixl) -> None:
    r0 = nx.router("nx-router-t0", {"routing": {"connector": "nixl", "threshold": 0}})
    answer, route = _chat(r0, "hi")
    assert route == "disaggregated"
    assert answer == _direct(nx.decoders[1], "hi")
    prompts = [
        json.loads(json.dumps(rec["body"]))
        for rec in json.loads(http_call(nx.prefill.url() + "/sim/requests")[2])
    ]
    kv = prompts[-1]["kv_transfer_params"]
    assert kv["do_remote_decode"] is True and prompts[-1]["max_tokens"] == 1
    assert prompts[-1]["stream"] is False
    # batched prompts and n > 1 are never split across engines: served directly
    _, _, hdrs = post_json(r0.url() + "/v1/completions", {"prompt": ["a b", "c d"]})
    assert hdrs["x-pd-route"] == "direct"
    _, _, hdrs = post_json(r0.url() + "/v1/completions", {"prompt": "a", "n": 2})
    assert hdrs["x-pd-route"] == "direct"


@pytest.mark.parametrize("route", ["direct", "disaggregated"])
def test_streamed_chunks_arrive_incrementally(nx: Nixl, router: Proc, route: str) -> None:
    # Both decoders hold their streams after the first token until released: if the router
    # buffered, the first chunk would never reach us before the release.
    text = "tell me" if route == "direct" else long_text(300)
    for d in nx.decoders:
        set_fault(d, "stall")
    raw = client(router).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-pd-route"] == route
    it = iter(raw.parse())
    first = next(it)
    assert first.choices[0].delta.role == "assistant"
    second = next(it)
    assert second.choices[0].delta.content
    for d in nx.decoders:
        http_call(d.url() + "/sim/release", "POST")
    rest = "".join(c.choices[0].delta.content or "" for c in it if c.choices)
    assert second.choices[0].delta.content + rest == _direct(nx.decoders[0], text, 5)


def test_prefill_error_and_timeout_fall_back(nx: Nixl, router: Proc) -> None:
    text = long_text(300)
    base = router.url()
    b_err = metric_value(base, "pd_router_fallbacks_total", {"reason": "prefill_error"})
    set_fault(nx.prefill, "error")
    assert _chat(router, text) == (_direct(nx.decoders[0], text), "fallback")
    assert metric_value(base, "pd_router_fallbacks_total", {"reason": "prefill_error"}) == b_err + 1
    b_to = metric_value(base, "pd_router_fallbacks_total", {"reason": "prefill_timeout"})
    set_fault(nx.prefill, "hang")  # prefillSeconds: 3 in this router's config
    assert _chat(router, text) == (_direct(nx.decoders[0], text), "fallback")
    assert (
        metric_value(base, "pd_router_fallbacks_total", {"reason": "prefill_timeout"}) == b_to + 1
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_failed_kv_load_is_served_again_without_the_handoff(
    nx: Nixl, chat: bool, stream: bool
) -> None:
    """The decoder's KV load fails (vLLM 0.31: a 500, or a 200 stream of the role chunk and
    [DONE], no token): the answer is the decoder's own, never an empty one, on the one decoder
    there is."""
    r = nx.router(f"nx-router-kvfail-{chat}-{stream}", decoders=[nx.decoders[0].url()])
    text = long_text(300)
    want = answer(nx.decoders[0].url(), chat, text, False, ignore_eos=True, max_tokens=8)[0]
    before = metric_value(r.url(), "pd_router_fallbacks_total", {"reason": "decode_retry"})
    set_fault(nx.decoders[0], "kv_load_fail", 1)
    got, n, route = answer(r.url(), chat, text, stream, ignore_eos=True, max_tokens=8)
    assert (got, n, route) == (want, 8, "fallback")
    assert metric_value(r.url(), "pd_router_fallbacks_total", {"reason": "decode_retry"}) == (
        before + 1
    )


def test_a_failed_handoff_quarantines_the_pair_and_ejects_neither_engine(nx: Nixl) -> None:
    """Every hand-off fails on the decoder (a side channel nobody answers on: vLLM answers that
    it could not read the KV), while both engines serve well: the failure is the pair's
    (pd_router.pairs). Even with passiveFailureThreshold 1 neither engine is ejected (before,
    the decoder was, and the client got a 500; then the prefiller was, which under the flexible
    layout took a serving engine out); the prompt is served whole, and the next long prompt
    goes whole without a prefill (handoff_failing) while the pair is out."""
    r = nx.router(
        "nx-router-kvfail-pair",
        {"health": {"intervalSeconds": 60, "passiveFailureThreshold": 1}},
        decoders=[nx.decoders[0].url()],
    )
    want = answer(nx.decoders[0].url(), True, long_text(300), False, ignore_eos=True, max_tokens=8)
    set_fault(nx.decoders[0], "kv_load_fail")  # every hand-off from now on
    got = answer(r.url(), True, long_text(300), False, ignore_eos=True, max_tokens=8)
    assert got == (want[0], 8, "fallback")

    def healthy(pool: str) -> float:
        return metric_value(r.url(), "pd_router_healthy_endpoints", {"pool": pool})

    assert (healthy("decode"), healthy("prefill")) == (1, 1)
    before = metric_value(r.url(), "pd_router_fallbacks_total", {"reason": "handoff_failing"})
    again = answer(r.url(), True, long_text(301), False, ignore_eos=True, max_tokens=8)
    assert again[2] == "fallback"
    assert metric_value(r.url(), "pd_router_fallbacks_total", {"reason": "handoff_failing"}) == (
        before + 1
    )


def test_decoder_failure_before_first_byte_is_retried(nx: Nixl) -> None:
    r = nx.router(
        "nx-router-retry", {"health": {"intervalSeconds": 60, "passiveFailureThreshold": 100}}
    )
    set_fault(nx.decoders[0], "error")
    for i in range(6):
        text = f"question {i}"
        assert _chat(r, text) == (_direct(nx.decoders[1], text), "direct")
    set_fault(nx.decoders[0], "hang")  # firstByteSeconds: 3
    for i in range(3):
        text = f"hang {i}"
        assert _chat(r, text, stream=False)[1] == "direct"
    assert metric_value(r.url(), "pd_router_retries_total", {"pool": "decode"}) >= 1


@pytest.mark.parametrize("route", ["direct", "disaggregated"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_whose_decoder_stalls_after_its_headers_is_retried(
    nx: Nixl, chat: bool, route: str
) -> None:
    """vLLM answers 200 at once and sends the first chunk with the first token: a decoder
    that stalls in between is a failure before the first byte, and is retried. A retried
    NIXL decode leg goes out without the hand-off (the blocks may be gone): route fallback."""
    r = nx.router(
        f"nx-router-stall-{chat}-{route}",
        {
            "routing": {"sessionAffinityHeader": "x-session-id"},
            "health": {"intervalSeconds": 60, "passiveFailureThreshold": 100},
        },
    )
    bad, good = nx.decoders
    eps = [Endpoint(d.url()) for d in nx.decoders]
    # a session that rendezvous hashing pins to the stalling decoder, so it is tried first
    session = next(
        k
        for k in (f"s{i}" for i in range(100))
        if balancing.pick(eps, balancing.decode_load, k).base == bad.url()
    )
    prompt = "q" if route == "direct" else long_text(300)
    set_fault(bad, "hang_after_headers")
    http_call(good.url() + "/sim/requests?clear=1")
    retries = metric_value(r.url(), "pd_router_retries_total", {"pool": "decode"})
    c = client(r, default_headers={"x-session-id": session})
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    if chat:
        api: Any = c.chat.completions
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        api = c.completions
        kw["prompt"] = prompt
    with api.with_streaming_response.create(stream=True, **kw) as resp:
        got_route = resp.headers["x-pd-route"]
        chunks = list(resp.parse())
    text = "".join(
        ((ch.choices[0].delta.content if chat else ch.choices[0].text) or "")
        for ch in chunks
        if ch.choices
    )
    assert text == answer(good.url(), chat, prompt, False, max_tokens=6, ignore_eos=True)[0]
    assert metric_value(r.url(), "pd_router_retries_total", {"pool": "decode"}) == retries + 1
    (served,) = [
        rec
        for rec in json.loads(http_call(good.url() + "/sim/requests")[2])
        if rec["path"].startswith("/v1/") and rec["body"].get("stream")
    ]
    assert "kv_transfer_params" not in served["body"]
    assert got_route == ("direct" if route == "direct" else "fallback")
    # the stalled stream was closed, so the engine gave it up
    wait_until(
        lambda: metric_value(bad.url(), "pd_sim_requests_hanging") == 0, "stalled stream closed"
    )


def test_passive_ejection_and_recovery(nx: Nixl) -> None:
    r = nx.router(
        "nx-router-eject",
        {"health": {"intervalSeconds": 0.5, "passiveFailureThreshold": 1, "unhealthyThreshold": 1}},
    )
    set_fault(nx.decoders[0], "unhealthy")
    wait_until(
        lambda: metric_value(r.url(), "pd_router_healthy_endpoints", {"pool": "decode"}) == 1,
        "decoder 0 removed",
    )
    for i in range(4):
        assert _chat(r, f"q{i}")[1] == "direct"
    set_fault(nx.decoders[0], "none")
    wait_until(
        lambda: metric_value(r.url(), "pd_router_healthy_endpoints", {"pool": "decode"}) == 2,
        "decoder 0 back",
    )


def test_no_healthy_decoder(nx: Nixl) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    r = nx.router("nx-router-dead", decoders=[dead])
    assert http_call(r.url() + "/health")[0] == 200
    assert http_call(r.url() + "/ready")[0] == 503
    status, body, hdrs = post_json(
        r.url() + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 503 and "retry-after" in hdrs
    assert body["error"]["message"]


def test_client_disconnect_closes_upstream(nx: Nixl, router: Proc) -> None:
    for d in nx.decoders:
        set_fault(d, "stall")
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(
            {"messages": [{"role": "user", "content": "bye"}], "stream": True, "max_tokens": 50}
        ),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the stream is flowing

    def running() -> float:
        return sum(metric_value(d.url(), "vllm:num_requests_running") for d in nx.decoders)

    assert running() == 1
    aborted = _engine_sum(nx.decoders, "pd_sim_aborted_total")
    conn.sock.close()
    conn.close()
    wait_until(lambda: running() == 0, "engine saw the disconnect and aborted")
    wait_until(
        lambda: _engine_sum(nx.decoders, "pd_sim_aborted_total") == aborted + 1, "engine aborted"
    )
    wait_until(
        lambda: metric_value(router.url(), "pd_router_client_disconnects_total") >= 1,
        "disconnect counted",
    )


def _engine_sum(engines: list[Proc], name: str) -> float:
    return sum(metric_value(e.url(), name) for e in engines)


@pytest.fixture(scope="module")
def alone(stack: Stack) -> tuple[Nixl, Proc]:
    """Engines that one router alone watches, a router whose timeouts never fire during a test.
    Their own engines, because the tests here count the requests hanging on an engine: a router
    that re-admits an engine (after one failed health check, as another test's fault causes)
    sends it the weights probe, which would hang there too and be counted. For the same reason
    this router does not probe weights: one health check timing out on a busy machine would
    have it re-admit an engine."""
    n = Nixl(stack, "nx-alone")
    r = n.router(
        "nx-router-patient",
        {
            "timeouts": {"prefillSeconds": 120, "firstByteSeconds": 120, "streamIdleSeconds": 120},
            "health": {"weightsCheck": False},
        },
    )
    return n, r


@pytest.fixture
def patient(alone: tuple[Nixl, Proc]) -> Iterator[tuple[Nixl, Proc]]:
    yield alone
    for e in (alone[0].prefill, *alone[0].decoders):
        set_fault(e, "none")


@pytest.mark.parametrize("leg", ["decode_direct", "prefill"])
def test_client_disconnect_before_first_byte_aborts_upstream(
    patient: tuple[Nixl, Proc], leg: str
) -> None:
    """A non-streaming client leaves while the engine is still working (direct route: the
    decoder; disaggregated route: the prefiller): the router closes that upstream request."""
    nx, r = patient
    engines = [nx.prefill] if leg == "prefill" else nx.decoders
    for e in engines:
        set_fault(e, "hang")
    text = long_text() if leg == "prefill" else "leaving soon"
    aborted = _engine_sum(engines, "pd_sim_aborted_total")
    gone = metric_value(r.url(), "pd_router_client_disconnects_total")
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 5}),
        headers={"Content-Type": "application/json"},
    )
    wait_until(lambda: _engine_sum(engines, "pd_sim_requests_hanging") == 1, "engine has it")
    conn.sock.close()
    conn.close()
    wait_until(
        lambda: _engine_sum(engines, "pd_sim_aborted_total") == aborted + 1,
        "engine saw the disconnect and aborted",
    )
    assert _engine_sum(engines, "pd_sim_requests_hanging") == 0
    wait_until(
        lambda: metric_value(r.url(), "pd_router_client_disconnects_total") == gone + 1,
        "disconnect counted",
    )


def test_overload_429_and_503(nx: Nixl) -> None:
    r = nx.router(
        "nx-router-small", {"limits": {"maxInFlight": 1, "maxQueued": 1, "queueTimeoutSeconds": 2}}
    )
    for d in nx.decoders:
        set_fault(d, "stall")
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": "hold", "stream": True, "max_tokens": 5}),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # occupies the only slot
    queued: dict[str, Any] = {}

    def second() -> None:
        queued["r"] = post_json(r.url() + "/v1/completions", {"prompt": "q", "max_tokens": 2})

    t = threading.Thread(target=second)
    t.start()
    wait_until(lambda: metric_value(r.url(), "pd_router_queued") == 1, "second request queued")
    status, body, hdrs = post_json(r.url() + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 429 and hdrs.get("retry-after")
    assert body["error"]["type"] == "rate_limit_error"
    t.join(30)
    status, body, hdrs = queued["r"]
    assert status == 503 and hdrs.get("retry-after")
    conn.close()


def _is_openai_error(body: Any, status: int) -> bool:
    err = body["error"]
    return (
        set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and err["message"]
        and err["type"] == "invalid_request_error"
        and err["code"] == status
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", [1, 2]),
        ("/v1/chat/completions", "just a string"),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": "ten"}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 1.5}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "stream": "yes"}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "temperature": "hot"}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "stream_options": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "model": 7}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": []}),
        ("/v1/completions", {"prompt": [1, "a"]}),
        ("/v1/completions", {"prompt": "x", "n": True}),
    ],
)
def test_wrong_types_are_400_in_openai_format(router: Proc, path: str, body: Any) -> None:
    status, got, hdrs = post_json(router.url() + path, body)
    assert status == 400, got
    assert hdrs["content-type"].startswith("application/json")
    assert _is_openai_error(got, 400), got


def test_bad_requests(router: Proc) -> None:
    url = router.url() + "/v1/chat/completions"
    status, _, data = http_call(url, "POST", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"]["message"].startswith("malformed JSON")
    assert _is_openai_error(json.loads(data), 400)
    with pytest.raises(openai.BadRequestError):
        client(router).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"n": "two"}
        )
    status, body, _ = post_json(url, {"messages": "hi"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = post_json(
        url, {"messages": [{"role": "user", "content": "x"}], "model": "other"}
    )
    assert status == 404
    status, _, _ = http_call(router.url() + "/v2/nothing")
    assert status == 404


def test_body_too_large(nx: Nixl) -> None:
    r = nx.router("nx-router-413", {"limits": {"maxBodyBytes": 2048}})
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    status, body, _ = post_json(r.url() + "/v1/chat/completions", big)
    assert status == 413 and body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 413
    # chunked upload without Content-Length
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=iter([json.dumps(big).encode()]),
        headers={"Content-Type": "application/json"},
        encode_chunked=True,
    )
    assert conn.getresponse().status == 413
    conn.close()


def test_a_client_stalling_mid_body_holds_no_slot_and_gets_408(nx: Nixl) -> None:
    r = nx.router(
        "nx-router-slow-body",
        {"limits": {"maxInFlight": 1, "maxQueued": 0}, "timeouts": {"clientBodySeconds": 1}},
    )
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    slow = socket.create_connection(("127.0.0.1", r.port), timeout=30)
    try:
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: slow-1\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5]
        )
        # the only slot stays free while the body is incomplete
        status, got, _ = post_json(r.url() + "/v1/completions", {"prompt": "y", "max_tokens": 2})
        assert status == 200, got
        head = slow.recv(65536)  # then the deadline answers the stalled client
        assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert b"x-request-id: slow-1" in head.lower()
        assert b"clientBodySeconds" in head
    finally:
        slow.close()
    counted = {"outcome": "body_timeout"}
    assert metric_value(r.url(), "pd_router_requests_total", counted) == 1


@pytest.mark.parametrize("encoding", ["gzip", "br", "zstd", "bogus"])
def test_a_compressed_body_is_415_not_500(router: Proc, encoding: str) -> None:
    status, hdrs, data = http_call(
        router.url() + "/v1/completions",
        "POST",
        b"this is not compressed at all",
        {"Content-Type": "application/json", "Content-Encoding": encoding, "X-Request-Id": "enc-1"},
    )
    assert status == 415, data
    assert _is_openai_error(json.loads(data), 415)
    assert "Content-Encoding" in json.loads(data)["error"]["message"]
    assert hdrs["x-request-id"] == "enc-1"
    assert "Traceback" not in router.log_tail()


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", {}, 400),
        (b'{"prompt": "x", "model": "other"}', {}, 404),
        (b'{"prompt": "x"}', {"Content-Encoding": "br"}, 415),
    ],
)
def test_router_made_answers_carry_the_request_id(
    router: Proc, body: bytes, headers: dict[str, str], status: int
) -> None:
    hdrs = {"Content-Type": "application/json", "X-Request-Id": "rid-42", **headers}
    got, resp_headers, _ = http_call(router.url() + "/v1/completions", "POST", body, hdrs)
    assert got == status
    assert resp_headers["x-request-id"] == "rid-42"


def test_upstream_4xx_passed_through_unchanged(nx: Nixl, router: Proc) -> None:
    req = {"messages": [{"role": "user", "content": "x"}], "temperature": -1}
    s_direct, b_direct, _ = post_json(nx.decoders[0].url() + "/v1/chat/completions", req)
    s_router, b_router, _ = post_json(router.url() + "/v1/chat/completions", req)
    assert s_direct == s_router == 400
    assert b_router == b_direct
    # also on the disaggregated route (the prefiller rejects it)
    req["messages"][0]["content"] = long_text()
    s_router, b_router, _ = post_json(router.url() + "/v1/chat/completions", req)
    assert s_router == 400 and b_router["error"]["type"] == "BadRequestError"
    # a long prompt of token ids, one outside the vocabulary: vLLM refuses it at generation
    # start, so the prefill leg's 400 is the answer, word for word (it was a 200 once)
    ids = {"prompt": [*range(1000, 1600), 10**6], "max_tokens": 4}
    s_direct, b_direct, _ = post_json(nx.decoders[0].url() + "/v1/completions", ids)
    s_router, b_router, h_router = post_json(router.url() + "/v1/completions", ids)
    assert s_direct == s_router == 400 and b_router == b_direct
    assert b_router["error"]["message"] == "Token id 1000000 is out of vocabulary"
    assert (h_router["x-pd-route"], h_router["x-pd-reason"]) == ("fallback", "prefill_refused")
    with pytest.raises(openai.BadRequestError):
        client(router).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )


def test_api_keys(nx: Nixl) -> None:
    r = nx.router(
        "nx-router-auth",
        {"auth": {"protectMetrics": True}},
        env={"PD_ROUTER_API_KEYS": "sekrit,other"},
    )
    with pytest.raises(openai.AuthenticationError):
        client(r, api_key="wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    ok = client(r, api_key="sekrit").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert ok.choices[0].message.content
    assert http_call(r.url() + "/health")[0] == 200
    assert http_call(r.url() + "/ready")[0] == 200
    assert http_call(r.url() + "/metrics")[0] == 401
    assert http_call(r.url() + "/metrics", headers={"Authorization": "Bearer other"})[0] == 200
    assert http_call(r.url() + "/v1/models")[0] == 401
    # a key that is not UTF-8 is just a wrong key (401, not a 500)
    msg = {"messages": [{"role": "user", "content": "x"}]}
    auth = {"Authorization": b"Bearer \xff\xfe"}
    assert post_raw_headers(r.port, "/v1/chat/completions", msg, auth) == 401
    # the 401 carries the caller's request id like every other answer
    hdrs = {"Authorization": "Bearer wrong", "X-Request-Id": "auth-1"}
    status, resp_headers, _ = http_call(r.url() + "/v1/completions", "POST", b"{}", hdrs)
    assert status == 401 and resp_headers["x-request-id"] == "auth-1"


def test_metrics_token_opens_metrics_only(nx: Nixl, tmp_path: Path) -> None:
    tokens = tmp_path / "metrics-token"
    tokens.write_text("scrape-token\n")
    r = nx.router(
        "nx-router-metrics-token",
        {"auth": {"protectMetrics": True, "metricsTokensFile": str(tokens)}},
        env={"PD_ROUTER_API_KEYS": "sekrit"},
    )
    bearer = {"Authorization": "Bearer scrape-token"}
    status, _, body = http_call(r.url() + "/metrics", headers=bearer)
    assert status == 200 and b"pd_router_requests_total" in body
    assert http_call(r.url() + "/metrics", headers={"Authorization": "Bearer sekrit"})[0] == 200
    assert http_call(r.url() + "/metrics")[0] == 401
    assert http_call(r.url() + "/metrics", headers={"Authorization": "Bearer nope"})[0] == 401
    # the scrape token is no API key
    assert http_call(r.url() + "/v1/models", headers=bearer)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(r, api_key="scrape-token").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )


def test_dns_discovery(nx: Nixl) -> None:
    # "localhost" resolves through the system resolver like a headless Service name does
    dec_port = nx.decoders[0].port
    r = nx.router(
        "nx-router-dns",
        {
            "pools": {
                "prefill": {"discovery": "static", "static": [nx.prefill.url()]},
                "decode": {
                    "discovery": "dns",
                    "static": [],
                    "dns": {"name": "localhost", "port": dec_port, "refreshSeconds": 1},
                },
            }
        },
    )
    assert metric_value(r.url(), "pd_router_healthy_endpoints", {"pool": "decode"}) >= 1
    assert _chat(r, "via dns") == (_direct(nx.decoders[0], "via dns"), "direct")


def test_session_affinity_pins_decoder(nx: Nixl) -> None:
    r = nx.router("nx-router-aff", {"routing": {"sessionAffinityHeader": "x-session-id"}})
    for d in nx.decoders:
        http_call(d.url() + "/sim/requests?clear=1")
    for i in range(8):
        _chat(r, f"turn {i}", extra_headers={"x-session-id": "user-42"})
    counts = [len(json.loads(http_call(d.url() + "/sim/requests")[2])) for d in nx.decoders]
    assert sorted(counts) == [0, 8]
    # a session id that is not UTF-8 still picks a decoder (no 500)
    msg = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    sess = {"x-session-id": b"\xff\xfe-user"}
    assert post_raw_headers(r.port, "/v1/chat/completions", msg, sess) == 200


def test_client_kv_transfer_params_never_reach_engines(nx: Nixl, router: Proc) -> None:
    """Hand-off fields are the router's alone: a client's ``kv_transfer_params`` (top level
    or smuggled in ``vllm_xargs``, which vLLM merges into the same place) reach no engine, on
    the direct and on the disaggregated route; the request id goes to every engine."""
    evil = {
        "do_remote_prefill": True,
        "do_remote_decode": True,
        "remote_engine_id": "evil-engine",
        "remote_block_ids": [6, 6, 6],
        "remote_host": "10.6.6.6",
        "remote_port": 6666,
    }
    engines = [nx.prefill, *nx.decoders]
    for e in engines:
        http_call(e.url() + "/sim/requests?clear=1")
    rid = "nixl-kv-" + uuid.uuid4().hex
    for text, route in (("short", "direct"), (long_text(), "disaggregated")):
        assert chat_with_client_kv(router, text, evil, rid) == route
    seen = {e.name: json.loads(http_call(e.url() + "/sim/requests")[2]) for e in engines}
    prefills = seen[nx.prefill.name]
    decodes = [rec for d in nx.decoders for rec in seen[d.name]]
    assert len(prefills) == 1 and len(decodes) == 2
    for rec in prefills + decodes:
        assert rec["x_request_id"] == rid
        assert "evil" not in json.dumps(rec["body"]) and "6666" not in json.dumps(rec["body"])
        assert rec["body"]["vllm_xargs"] == {"keep_me": 1}  # the rest passes through
    assert prefills[0]["body"]["kv_transfer_params"] == handoff_nixl.PREFILL_PARAMS
    kv_by_route = sorted(
        (rec["body"].get("kv_transfer_params") or {}).get("remote_engine_id", "none")
        for rec in decodes
    )
    assert kv_by_route[0] != "none" and kv_by_route[1] == "none"  # only the disagg leg has kv


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_are_logged_only_when_configured(nx: Nixl, log_prompts: bool) -> None:
    r = nx.router(
        f"nx-router-log-{log_prompts}".lower(),
        {"logging": {"level": "info", "logPrompts": log_prompts}},
    )
    secret = "zebra-" + uuid.uuid4().hex
    rid = "log-" + uuid.uuid4().hex
    for text in (f"my secret is {secret}", f"{long_text()} {secret}"):  # both routes
        _chat(r, text, extra_headers={"X-Request-Id": rid})
    wait_until(lambda: r.log_tail(10**6).count(rid) >= 2, "request lines logged")
    lines = [json.loads(x) for x in r.log_tail(10**6).splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == rid]
    assert {x["route"] for x in mine if x["msg"] == "request"} == {"direct", "disaggregated"}
    assert (secret in r.log_tail(10**6)) is log_prompts


# ---------------------------------------------------------------------- KV revisions
def test_revision_pairs_learnt_from_the_engines_models_list(stack: Stack) -> None:
    """Each engine's KV revision, read from its /v1/models (pd_router.revision): a prefiller of
    revision a is paired only with the decoder of revision a, both legs naming a's model; a
    decoder of b alone gets long prompts directly (fallback no_revision_pair)."""
    a, b = "aaaaaaaaaa", "bbbbbbbbbb"
    pre = stack.sim("rev-prefill", "--kv-connector", "nixl", "--alias", f"{MODEL}@kv-{a}")
    dec_a = stack.sim("rev-decode-a", "--kv-connector", "nixl", "--alias", f"{MODEL}@kv-{a}")
    dec_b = stack.sim("rev-decode-b", "--kv-connector", "nixl", "--alias", f"{MODEL}@kv-{b}")
    cfg = {
        "routing": {"connector": "nixl", "threshold": 256, "decision": "length"},
        "pools": {
            "prefill": {"discovery": "static", "static": [pre.url()]},
            "decode": {"discovery": "static", "static": [dec_a.url(), dec_b.url()]},
        },
    }
    router = stack.router("rev-router", write_config(stack.workdir, "rev-router", cfg))
    _, _, raw = http_call(router.url() + "/v1/models")
    (card,) = json.loads(raw)["data"]
    assert card["id"] == MODEL  # the revisions' names are the router's business, not listed
    assert card["kv_revisions"] == {"prefill": {a: 1}, "decode": {a: 1, b: 1}}
    for _ in range(6):  # whichever decoder the balancer would have picked
        raw_resp = client(router).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": long_text()}], max_tokens=4
        )
        h = raw_resp.headers
        assert (h["x-pd-route"], h["x-pd-kv-revision"]) == ("disaggregated", a)
    assert metric_value(dec_b.url(), "pd_sim_kv_remote_prefill_total") == 0
    assert metric_value(dec_a.url(), "pd_sim_kv_remote_prefill_total") == 6
    revs = metric_value(
        router.url(), "pd_router_kv_revision_endpoints", {"pool": "decode", "revision": b}
    )
    assert revs == 1

    only_b = {
        **cfg,
        "pools": {**cfg["pools"], "decode": {"discovery": "static", "static": [dec_b.url()]}},
    }
    lone = stack.router("rev-router-b", write_config(stack.workdir, "rev-router-b", only_b))
    raw_resp = client(lone).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": long_text()}], max_tokens=4
    )
    h = raw_resp.headers
    assert (h["x-pd-route"], h["x-pd-reason"], h["x-pd-kv-revision"]) == (
        "fallback",
        "no_revision_pair",
        b,
    )
    assert (
        metric_value(lone.url(), "pd_router_fallbacks_total", {"reason": "no_revision_pair"}) == 1
    )


def test_engines_of_one_revision_with_other_weights_are_not_paired(stack: Stack) -> None:
    """A prefiller that answers the weights probe unlike the decoder (the simulator's
    ``--weights-seed``: a pod that loaded another upstream commit under one revision) is paired
    with nothing of the decoder's weights: long prompts are served whole (fallback
    ``weights_differ``), the log names both engines and the gauge counts two weight sets. With
    ``health.weightsCheck`` off (negative control) the same engines are paired."""
    a = "cccccccccc"
    alias = f"{MODEL}@kv-{a}"
    pre = stack.sim("w-prefill", "--kv-connector", "nixl", "--alias", alias, "--weights-seed", "7")
    dec = stack.sim("w-decode", "--kv-connector", "nixl", "--alias", alias)

    def router(name: str, check: bool) -> Proc:
        cfg = {
            "routing": {"connector": "nixl", "threshold": 256, "decision": "length"},
            "health": {"weightsCheck": check},
            "pools": {
                "prefill": {"discovery": "static", "static": [pre.url()]},
                "decode": {"discovery": "static", "static": [dec.url()]},
            },
        }
        return stack.router(name, write_config(stack.workdir, name, cfg))

    def route(r: Proc) -> tuple[str, str]:
        h = (
            client(r)
            .chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": long_text()}], max_tokens=4
            )
            .headers
        )
        return h["x-pd-route"], h.get("x-pd-reason", "")

    on = router("w-router", True)
    assert route(on) == ("fallback", "weights_differ")
    assert metric_value(on.url(), "pd_router_fallbacks_total", {"reason": "weights_differ"}) == 1
    # whichever was read first is set 0
    sets = {
        pool: [
            w
            for w in ("0", "1")
            if metric_value(
                on.url(),
                "pd_router_weight_set_endpoints",
                {"pool": pool, "revision": a, "weights": w},
            )
            == 1
        ]
        for pool in ("prefill", "decode")
    }
    assert sorted(sets["prefill"] + sets["decode"]) == ["0", "1"], sets
    (line,) = [x for x in on.log_tail(10**6).splitlines() if "holds other weights than" in x]
    assert pre.url() in line and dec.url() in line
    assert route(router("w-router-off", False))[0] == "disaggregated"  # negative control
