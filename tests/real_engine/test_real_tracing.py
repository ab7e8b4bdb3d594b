"""Traces on the real engine: the dev environment rendered with tracing on (router and both
engines exporting over OTLP/gRPC), vLLM's CPU build as prefiller and decoder, the real
OpenTelemetry Collector receiving every span. vLLM's own ``llm_request`` span (vLLM 0.31.0,
v1/engine/output_processor.py do_tracing: kind SERVER, parent read from the request's
``traceparent``) sits under the router's leg that sent that request: the prefill leg's on the
prefiller, the decode leg's on the decoder, the fallback's decode leg after a broken hand-off.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pd_router_dev.devstack import Proc, Stack
from pd_router_dev.otelcol import Collector

from tests.engines import rendered
from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.prompts import LONG_WORDS, SHORT_WORDS, text
from tests.real_engine.routers import Routers
from tests.real_engine.test_real_faults import _spawn_tamper, arm

RENDER = "env:dev traced"
ROUTER = "pd-pd-inference-router"  # the router's service.name as the chart names it (tracing.serviceName)
PREFILL, DECODE = "pd-pd-inference-prefill", "pd-pd-inference-decode"  # the chart's OTEL_SERVICE_NAME


@pytest.fixture(scope="module")
def rig(pairs: Pairs, routers: Routers, workdir: Path) -> Iterator[tuple[Collector, dict[str, engines.Engine], Proc]]:
    col = Collector(workdir, "real-otelcol")
    try:
        pd = pairs.get("dense", RENDER, otlp=col.grpc)
        router = routers.start(
            [pd["prefill"].url],
            [pd["decode"].url],
            sets=rendered.TRACING_SETS,
            env={"PD_ROUTER__TRACING__ENDPOINT": col.grpc},
        )
        yield col, pd, router
    finally:
        pairs.stop()  # the traced pair is this module's own
        col.stop()


def _ask(base: str, model: str, prompt: str, stream: bool) -> tuple[str, Any]:
    """A chat request carrying a sampled traceparent of a fresh trace: (trace id, response)."""
    tid = uuid.uuid4().hex
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    kw: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        "extra_headers": {"traceparent": f"00-{tid}-{uuid.uuid4().hex[:16]}-01"},
    }
    if stream:
        with c.chat.completions.with_streaming_response.create(stream=True, **kw) as resp:
            assert [ch for ch in resp.parse() if ch.choices]
            return tid, resp
    raw = c.chat.completions.with_raw_response.create(**kw)
    assert raw.parse().choices[0].message.content is not None
    return tid, raw


def _wait(col: Collector, tid: str, want: dict[tuple[str, str], int]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The trace's spans by (service, name) once each of ``want`` has its count."""

    def complete(spans: list[dict[str, Any]]) -> bool:
        got: dict[tuple[str, str], int] = {}
        for s in spans:
            got[(s["service"], s["name"])] = got.get((s["service"], s["name"]), 0) + 1
        return all(got.get(k, 0) >= n for k, n in want.items())

    spans = col.trace(tid, complete, f"every span of {sorted(want)}", deadline_s=120)
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in spans:
        out.setdefault((s["service"], s["name"]), []).append(s)
    return out


def _inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    """``child`` nests under ``parent`` (by span ids: the wall clock the timestamps come from
    was seen to step by 94 s on these machines under load, so times are not compared)."""
    return child.get("parentSpanId") == parent["spanId"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_real_trace_nixl_route_has_vllms_spans_under_the_router_legs(
    stream: bool, rig: tuple[Collector, dict[str, engines.Engine], Proc], model_name: str
) -> None:
    col, _, router = rig
    tid, resp = _ask(router.url(), model_name, text(f"traced-long-{stream}", LONG_WORDS), stream)
    assert resp.headers["x-pd-route"] == "disaggregated"
    by = _wait(
        col,
        tid,
        {
            (ROUTER, "POST /v1/chat/completions"): 1,
            (ROUTER, "prefill"): 1,
            (ROUTER, "decode"): 1,
            (PREFILL, "llm_request"): 1,
            (DECODE, "llm_request"): 1,
        },
    )
    ((root,),) = [by[(ROUTER, "POST /v1/chat/completions")]]
    (pre,), (dec,) = by[(ROUTER, "prefill")], by[(ROUTER, "decode")]
    (vpre,), (vdec,) = by[(PREFILL, "llm_request")], by[(DECODE, "llm_request")]
    assert root["attrs"]["pd.route"] == "disaggregated"
    assert _inside(pre, root) and _inside(dec, root)
    assert _inside(vpre, pre), "vLLM's prefill span is not under the router's prefill leg"
    assert _inside(vdec, dec), "vLLM's decode span is not under the router's decode leg"
    assert vpre["kind"] == vdec["kind"] == 2  # SERVER, as vLLM makes it
    # what vLLM says of each leg: the prefiller made one token, the decoder the answer, of
    # one prompt; both name the request the router sent them
    assert vpre["attrs"]["gen_ai.usage.completion_tokens"] == 1
    assert vdec["attrs"]["gen_ai.usage.completion_tokens"] == 8
    assert vpre["attrs"]["gen_ai.usage.prompt_tokens"] == vdec["attrs"]["gen_ai.usage.prompt_tokens"]
    assert vdec["attrs"]["gen_ai.usage.prompt_tokens"] > 0
    for v in (vpre, vdec):
        assert root["attrs"]["pd.request_id"] in v["attrs"]["gen_ai.request.id"]
    assert vdec["resource"]["k8s.pod.name"] == "decode-0"  # the chart's resource attributes


def test_real_trace_direct_route_has_the_decoders_span_only(
    rig: tuple[Collector, dict[str, engines.Engine], Proc], model_name: str
) -> None:
    col, _, router = rig
    tid, resp = _ask(router.url(), model_name, text("traced-short", SHORT_WORDS), False)
    assert resp.headers["x-pd-route"] == "direct"
    by = _wait(col, tid, {(ROUTER, "POST /v1/chat/completions"): 1, (ROUTER, "decode"): 1, (DECODE, "llm_request"): 1})
    (dec,), (vdec,) = by[(ROUTER, "decode")], by[(DECODE, "llm_request")]
    assert _inside(vdec, dec)
    assert (PREFILL, "llm_request") not in by and (ROUTER, "prefill") not in by


def test_real_trace_fallback_puts_the_retried_leg_under_its_reason(
    rig: tuple[Collector, dict[str, engines.Engine], Proc], routers: Routers, workdir: Path, model_name: str
) -> None:
    """The decoder cannot reach the side channel the prefiller's answer names (the tampering
    proxy of test_real_faults.py): its first decode leg fails, the router decodes the prompt
    again without the hand-off, and the trace says where the time went."""
    col, pd, _ = rig
    with Stack(workdir / "tamper-traced") as st:
        proxy = st.adopt(_spawn_tamper(workdir, pd["prefill"]))
        router = routers.start(
            [proxy.url()],
            [pd["decode"].url],
            sets=rendered.TRACING_SETS,
            env={"PD_ROUTER__TRACING__ENDPOINT": col.grpc},
        )
        arm(proxy, "wrong_port")
        tid, resp = _ask(router.url(), model_name, text("traced-fallback", LONG_WORDS), False)
    assert (resp.headers["x-pd-route"], resp.headers["x-pd-reason"]) == ("fallback", "decode_retry")
    by = _wait(
        col,
        tid,
        {(ROUTER, "POST /v1/chat/completions"): 1, (ROUTER, "decode"): 2, (PREFILL, "llm_request"): 1},
    )
    (root,) = by[(ROUTER, "POST /v1/chat/completions")]
    assert root["attrs"]["pd.fallback.reason"] == "decode_retry"
    assert any(e["name"] == "fallback" for e in root.get("events", []))
    first, second = sorted(by[(ROUTER, "decode")], key=lambda s: s["attrs"]["pd.attempt"])
    assert first["attrs"]["pd.kv_transfer_params"] is True and first["status"].get("code") == 2
    assert second["attrs"]["pd.kv_transfer_params"] is False and second["attrs"]["http.response.status_code"] == 200
    assert [e["name"] for e in second.get("events", [])] == ["first_token"]
    (vpre,) = by[(PREFILL, "llm_request")]
    (pre,) = by[(ROUTER, "prefill")]
    assert _inside(vpre, pre)  # through the proxy, which passes the trace context on
    # the decoder's span of the retried leg, under that leg (the failed one may add its own)
    by = _wait(col, tid, {(DECODE, "llm_request"): 1})
    assert any(_inside(v, second) for v in by[(DECODE, "llm_request")])
