"""LMCache PD with ``notificationReceiver: prefillSidecar``: a ``pd-router notify-sidecar`` next
to the prefiller receives the ProxyNotif messages; several router replicas ask it."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from pd_router.config import ConfigError, parse_config
from pd_router.handoff.lmcache_wire import encode_notif
from pd_router_dev.devstack import Proc, Stack, free_port
from router_testlib import (
    MODEL,
    LMCacheStack,
    client,
    http_call,
    long_text,
    metric_value,
    post_json,
    run_cli,
    set_fault,
    wait_until,
)


@dataclass
class SidecarStack:
    lm: LMCacheStack
    sidecar: Proc
    zmq_port: int
    routers: list[Proc]
    unbound_notify_port: int

    def router_over(self, **lmcache: Any) -> dict[str, Any]:
        return {
            "lmcache": {
                "notificationReceiver": "prefillSidecar",
                "sidecarPort": self.sidecar.port,
                "notifyPort": self.unbound_notify_port,
                **lmcache,
            }
        }


@pytest.fixture(scope="module")
def sc(stack: Stack) -> Iterator[SidecarStack]:
    zmq_port = free_port()
    sidecar = stack.notify_sidecar("lm-sidecar", zmq_port)  # before the prefiller PUSHes
    lm = LMCacheStack(stack, pd_proxy_port=zmq_port)
    # both routers name the same notifyPort: in router mode the second could not start
    s = SidecarStack(lm, sidecar, zmq_port, [], free_port())
    s.routers = [lm.router(f"lm-sc-router{i}", s.router_over()) for i in range(2)]
    yield s


def _push(port: int, *messages: bytes) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        for m in messages:
            sock.send(m)
        sock.close()
    finally:
        ctx.term()


def _sidecar_metric(sidecar: Proc, name: str, labels: dict[str, str] | None = None) -> float:
    return metric_value(sidecar.url(), name, labels)


def _wait(sidecar: Proc, req_id: str, query: str) -> tuple[int, Any]:
    status, _, data = http_call(f"{sidecar.url()}/v1/notifications/{req_id}?{query}")
    return status, json.loads(data)


def _chat(router: Proc, content: str, stream: bool = False) -> tuple[str, str]:
    c = client(router)
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        with c.chat.completions.with_streaming_response.create(stream=True, **kw) as resp:
            route = resp.headers["x-pd-route"]
            chunks = list(resp.parse())
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), route
    raw = c.chat.completions.with_raw_response.create(**kw)
    return raw.parse().choices[0].message.content or "", raw.headers["x-pd-route"]


def _direct(s: SidecarStack, content: str) -> str:
    status, body, _ = post_json(
        s.lm.decoders[0].url("127.0.0.2") + "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 12,
            "ignore_eos": True,
        },
    )
    assert status == 200
    return body["choices"][0]["message"]["content"]


def test_two_routers_disaggregated_equal_direct(sc: SidecarStack) -> None:
    ok_before = _sidecar_metric(sc.sidecar, "pd_notify_sidecar_waits_total", {"outcome": "ok"})
    for i, router in enumerate(sc.routers):
        waits_ok = {"outcome": "ok"}
        router_ok = metric_value(router.url(), "pd_router_lmcache_sidecar_waits_total", waits_ok)
        for stream in (False, True):
            text = long_text(400 + 10 * i + (5 if stream else 0))
            answer, route = _chat(router, text, stream)
            assert route == "disaggregated"
            assert answer == _direct(sc, text)
        assert metric_value(router.url(), "pd_router_lmcache_sidecar_waits_total", waits_ok) == (
            router_ok + 2
        )
        # the router received nothing itself
        assert metric_value(router.url(), "pd_router_lmcache_notifications_total") == 0
    # completions, with a request id the sidecar URL must percent-encode ("/", "+", "=")
    rid = f"tenant/a+b=c-{uuid.uuid4().hex}"
    prompt = long_text(333)
    status, body, hdrs = post_json(
        sc.routers[1].url() + "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 7, "ignore_eos": True},
        {"X-Request-Id": rid},
    )
    assert status == 200 and hdrs["x-pd-route"] == "disaggregated"
    assert hdrs["x-request-id"] == rid
    status, direct, _ = post_json(
        sc.lm.decoders[0].url("127.0.0.2") + "/v1/completions",
        {"prompt": prompt, "max_tokens": 7, "ignore_eos": True},
    )
    assert body["choices"][0]["text"] == direct["choices"][0]["text"]
    assert _sidecar_metric(sc.sidecar, "pd_notify_sidecar_waits_total", {"outcome": "ok"}) == (
        ok_before + 5
    )
    # every request got its two (TP 2) notifications through the sidecar
    assert (
        _sidecar_metric(sc.sidecar, "pd_notify_sidecar_notifications_total", {"result": "received"})
        >= 2 * 5
    )
    # neither router bound the ZMQ port named in its config
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", sc.unbound_notify_port))


def test_notification_before_wait_is_not_lost(sc: SidecarStack) -> None:
    req_id = "early-" + uuid.uuid4().hex
    received = {"result": "received"}
    before = _sidecar_metric(sc.sidecar, "pd_notify_sidecar_notifications_total", received)
    _push(sc.zmq_port, encode_notif(req_id), encode_notif(req_id), b"\x00not msgpack")
    wait_until(
        lambda: (
            _sidecar_metric(sc.sidecar, "pd_notify_sidecar_notifications_total", received)
            == before + 2
        ),
        "sidecar received both notifications",
    )
    assert _wait(sc.sidecar, req_id, "count=2&timeout=30") == (
        200,
        {"req_id": req_id, "received": 2},
    )
    # the entry is gone after a successful wait
    status, err = _wait(sc.sidecar, req_id, "count=1&timeout=0.2")
    assert status == 504 and err["error"]["code"] == 504
    wait_until(
        lambda: (
            _sidecar_metric(
                sc.sidecar, "pd_notify_sidecar_notifications_total", {"result": "malformed"}
            )
            >= 1
        ),
        "malformed counted",
    )


def test_wait_then_notifications_arrive(sc: SidecarStack) -> None:
    req_id = "late-" + uuid.uuid4().hex
    pending = "pd_notify_sidecar_pending_entries"
    before = _sidecar_metric(sc.sidecar, pending)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_wait, sc.sidecar, req_id, "count=2&timeout=30")
        wait_until(lambda: _sidecar_metric(sc.sidecar, pending) == before + 1, "waiter seen")
        _push(sc.zmq_port, encode_notif(req_id))
        _push(sc.zmq_port, encode_notif(req_id))
        assert fut.result() == (200, {"req_id": req_id, "received": 2})
    assert _sidecar_metric(sc.sidecar, pending) == before


def test_missing_notification_falls_back(sc: SidecarStack) -> None:
    router = sc.routers[0]
    text = long_text(420)
    fb = {"reason": "notify_timeout"}
    before = metric_value(router.url(), "pd_router_fallbacks_total", fb)
    r_to = {"outcome": "timeout"}
    r_timeouts = metric_value(router.url(), "pd_router_lmcache_sidecar_waits_total", r_to)
    timeouts = _sidecar_metric(sc.sidecar, "pd_notify_sidecar_waits_total", {"outcome": "timeout"})
    set_fault(sc.lm.prefill, "no_notify")
    try:
        answer, route = _chat(router, text)
        assert route == "fallback"
        assert answer == _direct(sc, text)
        # streaming: the first token was already sent as disaggregated; the metric counts it
        answer, route = _chat(router, text, stream=True)
        assert route == "disaggregated"
        assert answer == _direct(sc, text)
    finally:
        set_fault(sc.lm.prefill, "none")
    assert metric_value(router.url(), "pd_router_fallbacks_total", fb) == before + 2
    assert metric_value(router.url(), "pd_router_lmcache_sidecar_waits_total", r_to) == (
        r_timeouts + 2
    )
    assert _sidecar_metric(sc.sidecar, "pd_notify_sidecar_waits_total", {"outcome": "timeout"}) == (
        timeouts + 2
    )


def test_sidecar_unreachable_falls_back(sc: SidecarStack) -> None:
    router = sc.lm.router("lm-sc-router-nosidecar", sc.router_over(sidecarPort=free_port()))
    text = long_text(430)
    answer, route = _chat(router, text)
    assert route == "fallback"
    assert answer == _direct(sc, text)
    assert (
        metric_value(router.url(), "pd_router_fallbacks_total", {"reason": "notify_timeout"}) == 1
    )
    assert metric_value(
        router.url(), "pd_router_lmcache_sidecar_waits_total", {"outcome": "error"}
    ) == (1)
    # counted against the prefiller (its pod's sidecar failed the hand-off)
    errors = {"pool": "prefill", "kind": "sidecar_error"}
    assert metric_value(router.url(), "pd_router_upstream_errors_total", errors) == 1


@pytest.mark.parametrize(
    "query",
    [
        "count=0&timeout=1",
        "count=65&timeout=1",
        "count=two&timeout=1",
        "count=1&timeout=0",
        "count=1&timeout=-1",
        "count=1&timeout=601",
        "count=1&timeout=nan",
        "count=1&timeout=inf",
        "count=1.5&timeout=1",
    ],
)
def test_bad_query_params_are_400(sc: SidecarStack, query: str) -> None:
    status, err = _wait(sc.sidecar, "x", query)
    assert status == 400
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == 400


def test_sidecar_health_metrics_404(sc: SidecarStack) -> None:
    assert http_call(sc.sidecar.url() + "/health")[0] == 200
    text = http_call(sc.sidecar.url() + "/metrics")[2].decode()
    for family, kind in (
        ("pd_notify_sidecar_notifications_total", "counter"),
        ("pd_notify_sidecar_waits_total", "counter"),
        ("pd_notify_sidecar_pending_entries", "gauge"),
        ("pd_notify_sidecar_dropped_entries_total", "counter"),
    ):
        assert f"# TYPE {family} {kind}" in text, family
    status, _, data = http_call(sc.sidecar.url() + "/v1/other")
    assert status == 404 and json.loads(data)["error"]["code"] == 404


def test_overflow_expiry_and_sigterm(stack: Stack) -> None:
    zmq_port = free_port()
    side = stack.notify_sidecar("lm-sidecar-small", zmq_port, "--max-pending", "2")
    dropped = "pd_notify_sidecar_dropped_entries_total"
    _push(zmq_port, encode_notif("a"), encode_notif("b"), encode_notif("c"))
    wait_until(lambda: metric_value(side.url(), dropped, {"reason": "overflow"}) == 1, "overflow")
    assert _wait(side, "a", "count=1&timeout=0.2")[0] == 504  # the oldest was dropped
    assert _wait(side, "c", "count=1&timeout=30") == (200, {"req_id": "c", "received": 1})
    assert metric_value(side.url(), "pd_notify_sidecar_pending_entries") == 1  # "b"
    side.stop()
    assert side.popen.returncode == 0  # SIGTERM: clean exit

    zmq_port = free_port()
    short = stack.notify_sidecar("lm-sidecar-ttl", zmq_port, "--ttl-seconds", "0.2")
    _push(zmq_port, encode_notif("gone"))
    wait_until(lambda: metric_value(short.url(), dropped, {"reason": "expired"}) == 1, "expired")
    assert metric_value(short.url(), "pd_notify_sidecar_pending_entries") == 0
    short.stop()
    assert short.popen.returncode == 0


def test_sidecar_refuses_bad_arguments() -> None:
    out = run_cli("notify-sidecar", "--max-pending", "0", "--port", "0")
    assert out.returncode == 2 and "--max-pending" in out.stderr
    taken = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", taken))
        sock.listen()
        out = run_cli("notify-sidecar", "--port", "0", "--zmq-bind", f"tcp://127.0.0.1:{taken}")
    assert out.returncode == 1 and "cannot bind --zmq-bind" in out.stderr


# ------------------------------------------------------------------ config contract
def test_config_defaults_and_contract() -> None:
    cfg = parse_config({})
    assert cfg.lmcache.notification_receiver == "router"
    assert cfg.lmcache.sidecar_port == 7600
    cfg = parse_config({"lmcache": {"notificationReceiver": "prefillSidecar", "sidecarPort": 7601}})
    assert cfg.lmcache.notification_receiver == "prefillSidecar"
    assert cfg.lmcache.sidecar_port == 7601
    cfg = parse_config({}, {"PD_ROUTER__LMCACHE__NOTIFICATIONRECEIVER": "prefillSidecar"})
    assert cfg.lmcache.notification_receiver == "prefillSidecar"


@pytest.mark.parametrize(
    ("lmcache", "field"),
    [
        ({"notificationReceiver": "bogus"}, "lmcache.notificationReceiver"),
        ({"notificationReceiver": 1}, "lmcache.notificationReceiver"),
        ({"sidecarPort": 0}, "lmcache.sidecarPort"),
        ({"sidecarPort": 65536}, "lmcache.sidecarPort"),
        ({"sidecarPort": "7600"}, "lmcache.sidecarPort"),
        (
            {"notificationReceiver": "prefillSidecar", "notifyTimeoutSeconds": 601},
            "lmcache.notifyTimeoutSeconds",
        ),
        (
            {"notificationReceiver": "prefillSidecar", "notificationsPerRequest": 65},
            "lmcache.notificationsPerRequest",
        ),
    ],
)
def test_config_errors_name_the_field(lmcache: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_config({"lmcache": lmcache})
    assert str(ei.value).startswith(field + ":"), str(ei.value)
