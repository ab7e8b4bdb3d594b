"""NIXL mode end to end, failure handling (section 7 of the issue) and the HTTP surface."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pd_router.devstack import Proc, Stack, free_port
from router_testlib import (
    MODEL,
    client,
    http_call,
    long_text,
    metric_value,
    post_json,
    set_fault,
    wait_until,
    write_config,
)


class Nixl:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.prefill = stack.sim("nx-prefill", "--kv-connector", "nixl")
        self.decoders = [stack.sim(f"nx-decode{i}", "--kv-connector", "nixl") for i in range(2)]

    def router(
        self,
        name: str,
        over: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        decoders: list[str] | None = None,
    ) -> Proc:
        cfg: dict[str, Any] = {
            "routing": {"connector": "nixl", "threshold": 256},
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


def test_streamed_chunks_arrive_incrementally(nx: Nixl, router: Proc) -> None:
    # Both decoders hold their streams after the first token until released: if the router
    # buffered, the first chunk would never reach us before the release.
    for d in nx.decoders:
        set_fault(d, "stall")
    stream = client(router).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    first = next(it)
    assert first.choices[0].delta.role == "assistant"
    second = next(it)
    assert second.choices[0].delta.content
    for d in nx.decoders:
        http_call(d.url() + "/sim/release", "POST")
    rest = "".join(c.choices[0].delta.content or "" for c in it if c.choices)
    assert second.choices[0].delta.content + rest == _direct(nx.decoders[0], "tell me", 5)


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
    conn.sock.close()
    conn.close()
    wait_until(lambda: running() == 0, "engine saw the disconnect and aborted")
    wait_until(
        lambda: metric_value(router.url(), "pd_router_client_disconnects_total") >= 1,
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


def test_bad_requests(router: Proc) -> None:
    url = router.url() + "/v1/chat/completions"
    status, _, data = http_call(url, "POST", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"]["message"].startswith("malformed JSON")
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


def test_upstream_4xx_passed_through_unchanged(nx: Nixl, router: Proc) -> None:
    req = {"messages": [{"role": "user", "content": "x"}], "temperature": -1}
    s_direct, b_direct, _ = post_json(nx.decoders[0].url() + "/v1/chat/completions", req)
    s_router, b_router, _ = post_json(router.url() + "/v1/chat/completions", req)
    assert s_direct == s_router == 400
    assert b_router == b_direct
    # also on the disaggregated route (the prefiller rejects it)
    req["messages"][0]["content"] = long_text()
    s_router, b_router, _ = post_json(router.url() + "/v1/chat/completions", req)
    assert s_router == 400 and b_router["object"] == "error"
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
