"""OpenTelemetry traces end to end: a real router process (pd_router.tracing) exporting over
OTLP to the real OpenTelemetry Collector (built from its Go modules, pd_router_dev.otelcol),
simulated engines recording the trace context each leg brings, the ``openai`` client as caller.

For every route, one trace whose spans nest as pd_router.tracing says and carry its attributes;
the context of the prefill and decode legs reaching the engines; a client's ``traceparent``
continued; an unsampled one, and tracing off, passed on unchanged; the trace id in the access
line; both OTLP protocols; a collector that is down costs the requests nothing. vLLM's own spans
under the router's: tests/real_engine/test_real_tracing.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pd_router_dev.devstack import Proc, Stack, free_port
from pd_router_dev.otelcol import Collector
from router_testlib import (
    MODEL,
    LMCacheStack,
    http_call,
    long_text,
    metric_value,
    set_fault,
    wait_until,
    write_config,
)

LONG = long_text(400)  # above the routers' threshold of 256 (one token per word)
SHORT = "hello there"


@pytest.fixture(scope="module")
def collector(stack: Stack) -> Iterator[Collector]:
    c = Collector(stack.workdir)
    yield c
    c.stop()


class Engines:
    """One NIXL prefiller and one decoder (simulated), and routers in front of them."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.prefill = stack.sim("tr-prefill", "--kv-connector", "nixl")
        self.decode = stack.sim("tr-decode", "--kv-connector", "nixl")

    def router(self, name: str, tracing: dict[str, Any] | None, **over: Any) -> Proc:
        cfg: dict[str, Any] = {
            "routing": {"connector": "nixl", "threshold": 256, "decision": "length"},
            "pools": {
                "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                "decode": {"discovery": "static", "static": [self.decode.url()]},
            },
            "timeouts": {"prefillSeconds": 3, "firstByteSeconds": 3, "streamIdleSeconds": 5},
            "logging": {"level": "info", "logPrompts": False},
            **over,
        }
        if tracing is not None:
            cfg["tracing"] = tracing
        return self.stack.router(name, write_config(self.stack.workdir, name, cfg))


@pytest.fixture(scope="module")
def engines(stack: Stack) -> Engines:
    return Engines(stack)


@pytest.fixture(scope="module")
def traced(engines: Engines, collector: Collector) -> Proc:
    return engines.router("tr-router", {"endpoint": collector.grpc, "samplingRatio": 1.0})


def _tp(sampled: bool = True) -> tuple[str, str, str]:
    """A client's traceparent: (header, trace id, span id)."""
    tid, sid = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{tid}-{sid}-{'01' if sampled else '00'}", tid, sid


def _chat(router: Proc, content: str, stream: bool = False, **headers: str) -> tuple[str, Any]:
    """One chat request through the openai client: (its request id, the raw response)."""
    rid = uuid.uuid4().hex
    c = openai.OpenAI(base_url=router.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "extra_headers": {"X-Request-Id": rid, **headers},
    }
    if stream:
        with c.chat.completions.with_streaming_response.create(stream=True, **kw) as resp:
            assert [ch for ch in resp.parse() if ch.choices]
            return rid, resp
    raw = c.chat.completions.with_raw_response.create(**kw)
    assert raw.parse().choices[0].message.content
    return rid, raw


def _access(router: Proc, rid: str) -> dict[str, Any]:
    """The router's access line of request ``rid`` (written once the request ended)."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        for line in router.log.read_text(errors="replace").splitlines():
            if f'"request_id":"{rid}"' in line and '"msg":"request"' in line:
                found.append(json.loads(line))
                return True
        return False

    wait_until(seen, f"the access line of {rid}")
    return found[0]


def _legs(engine: Proc | str, rid: str) -> list[dict[str, Any]]:
    """What ``engine`` (or the engine at that URL) recorded of request ``rid``'s legs
    (traceparent and tracestate among it)."""
    url = engine if isinstance(engine, str) else engine.url()
    _, _, data = http_call(url + "/sim/requests")
    return [r for r in json.loads(data) if r["x_request_id"] == rid]


def _by_name(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        out.setdefault(s["name"], []).append(s)
    return out


def _router_trace(
    collector: Collector, tid: str, names: set[str]
) -> dict[str, list[dict[str, Any]]]:
    spans = collector.trace(
        tid,
        lambda sp: names <= {s["name"] for s in sp if s["service"] == "pd-router"},
        f"the router's spans {sorted(names)}",
    )
    return _by_name([s for s in spans if s["service"] == "pd-router"])


def _check_root(by: dict[str, list[dict[str, Any]]], route: str, reason: str) -> dict[str, Any]:
    (root,) = by["POST /v1/chat/completions"]
    a = root["attrs"]
    assert root["kind"] == "SPAN_KIND_SERVER" or root["kind"] == 2
    assert (a["pd.route"], a["pd.reason"], a["http.response.status_code"]) == (route, reason, 200)
    assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/chat/completions"
    assert a["pd.outcome"] == "ok" and a["pd.ttft_ms"] > 0
    for name, spans in by.items():  # every span of the router is inside the request's
        for s in spans:
            assert int(root["startTimeUnixNano"]) <= int(s["startTimeUnixNano"]), name
            assert int(s["endTimeUnixNano"]) <= int(root["endTimeUnixNano"]), name
    return root


def _child_of(span: dict[str, Any], parent: dict[str, Any]) -> bool:
    return span.get("parentSpanId") == parent["spanId"]


def _leg_parent(leg: dict[str, Any], tid: str) -> str:
    """The parent span id a leg's traceparent names (its trace id checked, sampled)."""
    version, trace_id, span_id, flags = leg["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", tid, "01"), leg["traceparent"]
    return span_id


def test_trace_direct_route_continues_the_clients_trace(
    traced: Proc, engines: Engines, collector: Collector
) -> None:
    header, tid, client_span = _tp()
    rid, _ = _chat(traced, SHORT, traceparent=header, tracestate="vendor=abc,rojo=00f067aa0ba902b7")
    by = _router_trace(
        collector, tid, {"POST /v1/chat/completions", "admission", "decision", "decode"}
    )
    root = _check_root(by, "direct", "below_threshold")
    assert root["parentSpanId"] == client_span  # the client's span is the router's parent
    assert root["traceState"] == "vendor=abc,rojo=00f067aa0ba902b7"
    (adm,), (dec,), (leg,) = by["admission"], by["decision"], by["decode"]
    assert _child_of(adm, root) and _child_of(dec, root) and _child_of(leg, root)
    d = dec["attrs"]
    assert (d["pd.decision.route"], d["pd.decision.reason"]) == ("direct", "below_threshold")
    assert d["pd.prompt_tokens"] > 0 and d["pd.decision.threshold"] == 256
    assert leg["kind"] in ("SPAN_KIND_CLIENT", 3)
    assert leg["attrs"]["pd.engine"] == engines.decode.url() and leg["attrs"]["pd.attempt"] == 1
    assert leg["attrs"]["http.response.status_code"] == 200
    assert [e["name"] for e in leg.get("events", [])] == ["first_token"]
    assert "prefill" not in by
    (sent,) = _legs(engines.decode, rid)  # the decoder got the decode leg's context
    assert _leg_parent(sent, tid) == leg["spanId"]
    assert sent["tracestate"] == "vendor=abc,rojo=00f067aa0ba902b7"
    assert _access(traced, rid)["trace_id"] == tid


def test_trace_nixl_route_carries_both_legs(
    traced: Proc, engines: Engines, collector: Collector
) -> None:
    rid, _ = _chat(traced, LONG, stream=True)  # no traceparent: the router starts the trace
    tid = _access(traced, rid)["trace_id"]
    assert len(tid) == 32
    by = _router_trace(
        collector, tid, {"POST /v1/chat/completions", "decision", "prefill", "decode"}
    )
    root = _check_root(by, "disaggregated", "above_threshold")
    assert "parentSpanId" not in root or not root["parentSpanId"]
    (pre,), (leg,) = by["prefill"], by["decode"]
    assert _child_of(pre, root) and _child_of(leg, root)
    assert int(pre["endTimeUnixNano"]) <= int(leg["startTimeUnixNano"])  # prefill, then decode
    assert pre["attrs"]["pd.engine"] == engines.prefill.url()
    assert leg["attrs"]["pd.kv_transfer_params"] is True
    assert [e["name"] for e in leg.get("events", [])] == ["first_token"]
    first = int(leg["events"][0]["timeUnixNano"])
    assert int(leg["startTimeUnixNano"]) <= first <= int(leg["endTimeUnixNano"])
    (p_sent,) = _legs(engines.prefill, rid)
    (d_sent,) = _legs(engines.decode, rid)
    assert _leg_parent(p_sent, tid) == pre["spanId"]
    assert _leg_parent(d_sent, tid) == leg["spanId"]
    assert d_sent["body"]["kv_transfer_params"]["do_remote_prefill"] is True


def test_trace_fallback_route_names_its_reason(
    traced: Proc, engines: Engines, collector: Collector
) -> None:
    set_fault(engines.prefill, "error", count=1)  # the prefill leg fails once: 503
    header, tid, _ = _tp()
    rid, raw = _chat(traced, LONG, traceparent=header)
    assert raw.headers["x-pd-route"] == "fallback"
    by = _router_trace(
        collector, tid, {"POST /v1/chat/completions", "prefill", "fallback", "decode"}
    )
    root = _check_root(by, "fallback", "prefill_error")
    assert root["attrs"]["pd.fallback.reason"] == "prefill_error"
    assert [e["name"] for e in root.get("events", [])] == ["fallback"]
    (pre,), (fb,), (leg,) = by["prefill"], by["fallback"], by["decode"]
    assert pre["status"].get("code") in ("STATUS_CODE_ERROR", 2)
    assert pre["status"]["message"] == "prefill_error"
    assert pre["attrs"]["http.response.status_code"] == 503
    assert fb["attrs"]["pd.fallback.reason"] == "prefill_error" and _child_of(fb, root)
    assert _child_of(leg, fb)  # the one decoder's leg is the fallback's
    assert "pd.kv_transfer_params" not in leg["attrs"]
    (d_sent,) = _legs(engines.decode, rid)
    assert _leg_parent(d_sent, tid) == leg["spanId"]


def test_trace_lmcache_route_waits_for_the_kv(stack: Stack, collector: Collector) -> None:
    lm = LMCacheStack(stack, name="trlm")
    router = lm.router(
        "trlm-router",
        {
            "tracing": {
                "endpoint": collector.http,
                "protocol": "http/protobuf",
                "samplingRatio": 1.0,
            }
        },
    )
    header, tid, _ = _tp()
    rid, _ = _chat(router, LONG, traceparent=header)
    names = {"POST /v1/chat/completions", "decision", "prefill", "kv_handoff_wait", "decode"}
    by = _router_trace(collector, tid, names)
    root = _check_root(by, "disaggregated", "above_threshold")
    (pre,), (wait,), (leg,) = by["prefill"], by["kv_handoff_wait"], by["decode"]
    for s in (pre, wait, leg):
        assert _child_of(s, root)
    assert wait["attrs"]["pd.kv_handoff.outcome"] == "ok"
    assert wait["attrs"]["pd.lmcache.notifications"] == 2
    # prefill, then the wait for its KV, then the decode leg
    assert int(pre["startTimeUnixNano"]) <= int(wait["startTimeUnixNano"])
    assert int(wait["endTimeUnixNano"]) <= int(leg["startTimeUnixNano"])
    (p_sent,) = _legs(lm.prefill, rid)
    assert _leg_parent(p_sent, tid) == pre["spanId"]
    d_sent = [leg_ for url in lm.decoder_urls() for leg_ in _legs(url, rid)]
    assert [_leg_parent(s, tid) for s in d_sent] == [leg["spanId"]]


def test_trace_not_sampled_by_the_client_is_passed_on_not_recorded(
    traced: Proc, engines: Engines, collector: Collector
) -> None:
    header, tid, _ = _tp(sampled=False)
    rid, _ = _chat(traced, LONG, traceparent=header)
    for e in (engines.prefill, engines.decode):  # both legs carry the client's context as it came
        (sent,) = _legs(e, rid)
        assert sent["traceparent"] == header
    assert _access(traced, rid)["trace_id"] == tid
    # exports go out in order: once a later sampled request's spans are in, this one's would be
    header2, tid2, _ = _tp()
    _chat(traced, SHORT, traceparent=header2)
    _router_trace(collector, tid2, {"POST /v1/chat/completions"})
    assert not [s for s in collector.spans() if s["traceId"] == tid]


def test_trace_ratio_zero_records_only_what_clients_sample(
    engines: Engines, collector: Collector
) -> None:
    router = engines.router("tr-ratio0", {"endpoint": collector.grpc, "samplingRatio": 0.0})
    rid, _ = _chat(router, SHORT)  # no traceparent, ratio 0: a trace nobody records
    tid = _access(router, rid)["trace_id"]
    (sent,) = _legs(engines.decode, rid)
    assert sent["traceparent"].startswith(f"00-{tid}-") and sent["traceparent"].endswith("-00")
    header2, tid2, _ = _tp()  # a client's sampled one is recorded all the same
    _chat(router, SHORT, traceparent=header2)
    _router_trace(collector, tid2, {"POST /v1/chat/completions", "decode"})
    assert not [s for s in collector.spans() if s["traceId"] == tid]


def test_tracing_off_passes_the_clients_trace_context_through(engines: Engines) -> None:
    router = engines.router("tr-off", None)
    header, tid, _ = _tp()
    rid, _ = _chat(router, LONG, traceparent=header, tracestate="vendor=abc")
    for e in (engines.prefill, engines.decode):
        (sent,) = _legs(e, rid)
        assert (sent["traceparent"], sent["tracestate"]) == (header, "vendor=abc")
    assert _access(router, rid)["trace_id"] == tid
    rid2, _ = _chat(router, SHORT, traceparent="00-" + "0" * 32 + "-" + "1" * 16 + "-01")
    (sent,) = _legs(engines.decode, rid2)  # an invalid one is dropped, as the SDK drops it
    assert sent["traceparent"] is None and _access(router, rid2)["trace_id"] == ""
    rid3, _ = _chat(router, SHORT)
    (sent,) = _legs(engines.decode, rid3)
    assert sent["traceparent"] is None


def test_trace_export_counts_and_a_collector_that_is_down(engines: Engines, traced: Proc) -> None:
    before = metric_value(traced.url(), "pd_router_trace_spans_total", {"outcome": "exported"})
    _chat(traced, SHORT)
    wait_until(
        lambda: (
            metric_value(traced.url(), "pd_router_trace_spans_total", {"outcome": "exported"})
            >= before + 4
        ),
        "the request's spans counted as exported",
    )
    down = engines.router(
        "tr-down",
        {"endpoint": f"http://127.0.0.1:{free_port()}", "samplingRatio": 1.0, "timeoutSeconds": 1},
    )
    for _ in range(3):  # nobody listens: requests are served all the same
        _chat(down, SHORT)
    wait_until(
        lambda: metric_value(down.url(), "pd_router_trace_spans_total", {"outcome": "failed"}) >= 4,
        "the spans counted as failed",
    )
    assert metric_value(down.url(), "pd_router_requests_total", {"outcome": "ok"}) == 3


def test_trace_of_a_remote_model_continues_in_its_own_router(
    stack: Stack, engines: Engines, collector: Collector
) -> None:
    """A request for another release's model (pd_router.remotes): the front's ``remote`` span,
    the other router's request span its child, in one trace."""
    other = "tr-other-model"
    decode = stack.sim("tr-other-decode", "--model", other)
    theirs_cfg = {
        "model": {"servedName": other},
        "pools": {
            "prefill": {"discovery": "static", "static": [decode.url()]},
            "decode": {"discovery": "static", "static": [decode.url()]},
        },
        "tracing": {"endpoint": collector.grpc, "serviceName": "pd-router-other"},
    }
    theirs = stack.router("tr-other", write_config(stack.workdir, "tr-other", theirs_cfg))
    front = engines.router(
        "tr-front",
        {"endpoint": collector.grpc},
        remoteModels=[{"name": other, "url": theirs.url()}],
    )
    header, tid, _ = _tp()
    c = openai.OpenAI(base_url=front.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
    c.chat.completions.create(
        model=other,
        messages=[{"role": "user", "content": SHORT}],
        max_tokens=4,
        extra_headers={"traceparent": header},
    )
    spans = collector.trace(
        tid,
        lambda sp: {"pd-router", "pd-router-other"} <= {s["service"] for s in sp},
        "both routers' spans",
    )
    ours = _by_name([s for s in spans if s["service"] == "pd-router"])
    theirs_spans = _by_name([s for s in spans if s["service"] == "pd-router-other"])
    (root,) = ours["POST /v1/chat/completions"]
    a = root["attrs"]
    assert (a["pd.route"], a["http.response.status_code"]) == ("remote", 200)
    (leg,) = ours["remote"]
    assert _child_of(leg, root) and leg["attrs"]["pd.engine"] == theirs.url()
    (their_root,) = theirs_spans["POST /v1/chat/completions"]
    assert _child_of(their_root, leg)  # the other router continues the front's trace
    assert "decode" in theirs_spans and "decode" not in ours
