"""pd_router.tracing in-process: its W3C header rules and its sampler against the pinned
OpenTelemetry SDK's own (the oracle: TraceContextTextMapPropagator, ParentBased(TraceIdRatioBased)),
the spans it hands the SDK's exporter, its export queue, and the headers file. The traces a real
router sends a real collector are in router/tests/test_router_tracing.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace as api
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pd_router import tracing
from pd_router.config import Tracing

PROPAGATOR = TraceContextTextMapPropagator()
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# headers of every shape the rules tell apart: versions, lengths, zero ids, case, extra fields
_hex = st.text("0123456789abcdef", min_size=0, max_size=34)
traceparents = st.one_of(
    st.builds(
        lambda v, t, s, f, rest: f"{v}-{t}-{s}-{f}{rest}",
        st.sampled_from(["00", "01", "ff", "cc", "0", "0A"]),
        st.one_of(st.just("0" * 32), _hex, st.just("0AF7651916CD43DD8448EB211C80319C")),
        st.one_of(st.just("0" * 16), _hex),
        st.sampled_from(["00", "01", "03", "ff", "1", "x1"]),
        st.sampled_from(["", "-", "-what-ever", " ", "\t", "-00"]),
    ),
    st.text(max_size=80),
    st.just(TP),
    st.just(" " + TP + "\t"),
)
tracestates = st.one_of(
    st.none(),
    st.just(""),
    st.lists(
        st.one_of(
            st.builds(
                lambda k, v: f"{k}={v}",
                st.sampled_from(["congo", "rojo", "a@b", "1a", "t0-x*/_", "A", "@x", "k" * 260]),
                st.sampled_from(["t61rcWkgMzE", "00f067aa0ba902b7", "x y", " x", "a,b", "a=b", ""]),
            ),
            st.sampled_from(["", " ", "garbage"]),
        ),
        max_size=35,
    ).map(",".join),
)


def sdk_extract(tp: str | None, ts: str | None) -> api.SpanContext:
    carrier = {} if tp is None else {"traceparent": tp}
    if ts is not None:
        carrier["tracestate"] = ts
    return api.get_current_span(PROPAGATOR.extract(carrier)).get_span_context()


@settings(max_examples=600, deadline=None)
@given(traceparents)
def test_traceparent_is_read_as_the_sdk_reads_it(tp: str) -> None:
    sc = sdk_extract(tp, None)
    got = tracing.parse_traceparent(tp)
    if not sc.is_valid:
        assert got is None
    else:
        assert got == (sc.trace_id, sc.span_id, int(sc.trace_flags))


@settings(max_examples=600, deadline=None)
@given(tracestates)
def test_tracestate_is_kept_or_dropped_as_the_sdk_does(ts: str | None) -> None:
    want = sdk_extract(TP, ts).trace_state
    got = tracing.parse_tracestate(ts)
    assert got == (want.to_header() if want else "")


def test_a_too_long_traceparent_is_ignored() -> None:
    assert tracing.parse_traceparent(TP + "-" + "a" * 600) is None
    assert not sdk_extract("01" + TP[2:] + "-" + "a" * 600, None).is_valid


def _sdk_sampled(ratio: float, trace_id: int, parent: tuple[int, int] | None) -> bool:
    sampler = ParentBased(TraceIdRatioBased(ratio))
    ctx = None
    if parent is not None:
        psc = api.SpanContext(parent[0], 1, True, api.TraceFlags(parent[1]))
        ctx = api.set_span_in_context(api.NonRecordingSpan(psc))
    return sampler.should_sample(ctx, trace_id, "x").decision.is_sampled()


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([0.0, 0.001, 0.1, 0.5, 0.999999, 1.0]),
    st.integers(1, (1 << 128) - 1),
    st.one_of(st.none(), st.sampled_from([0, 1, 2, 3, 255])),
)
def test_sampling_decides_as_parentbased_traceidratio(
    ratio: float, trace_id: int, flags: int | None
) -> None:
    tracer = tracing.Tracer(Tracing(endpoint="http://x:4317", sampling_ratio=ratio), _no_count)
    if flags is None:  # no parent: the ratio decides on an id the router draws
        tracing._rand.seed(trace_id)
        drawn = tracing._rand.getrandbits(128)
        tracing._rand.seed(trace_id)
        trace, fwd, tid = tracer.begin(None, None, "POST", "/v1/completions")
        assert tid == f"{drawn:032x}"
        assert (trace is not None) == _sdk_sampled(ratio, drawn, None)
    else:
        tp = f"00-{trace_id:032x}-00f067aa0ba902b7-{flags:02x}"
        trace, fwd, tid = tracer.begin(tp, None, "POST", "/v1/completions")
        assert tid == f"{trace_id:032x}"
        assert (trace is not None) == _sdk_sampled(ratio, trace_id, (trace_id, flags))
    if trace is None:  # what the engines get: a traceparent the SDK reads as not sampled
        line = fwd.decode()
        assert line.startswith("traceparent: ") and line.endswith("\r\n")
        sc = sdk_extract(line.split(": ", 1)[1].strip(), None)
        assert sc.is_valid and not sc.trace_flags.sampled and f"{sc.trace_id:032x}" == tid
        if flags is not None:  # the client's parent span passes on unchanged
            assert sc.span_id == 0x00F067AA0BA902B7
    else:
        assert fwd == b""


def _no_count(outcome: str, n: int) -> None:
    pass


def test_tracing_off_forwards_the_clients_headers_unchanged_when_valid() -> None:
    fwd, tid = tracing.forward(TP, "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE")
    assert fwd == (
        f"traceparent: {TP}\r\ntracestate: rojo=00f067aa0ba902b7,congo=t61rcWkgMzE\r\n".encode()
    )
    assert tid == "0af7651916cd43dd8448eb211c80319c"
    assert tracing.forward("00-" + "0" * 32 + "-b7ad6b7169203331-01", None) == (b"", "")
    assert tracing.forward(TP, "bad\r\nX-Injected: 1") == (f"traceparent: {TP}\r\n".encode(), tid)


class FakeOtlp:
    """Stands in for the SDK's OTLP exporter: keeps what it is handed, or fails."""

    def __init__(
        self, result: Any = SpanExportResult.SUCCESS, block: threading.Event | None = None
    ):
        self.result = result
        self.block = block
        self.batches: list[list[Any]] = []
        self.shut = False
        self.entered = threading.Event()

    def export(self, spans: list[Any]) -> Any:
        self.entered.set()
        if self.block is not None:
            self.block.wait(30)
        self.batches.append(spans)
        return self.result

    def shutdown(self) -> None:
        self.shut = True


def _exporter(fake: FakeOtlp, counts: dict[str, int], **cfg: Any) -> tracing.Exporter:
    def count(outcome: str, n: int) -> None:
        counts[outcome] = counts.get(outcome, 0) + n

    ex = tracing.Exporter(Tracing(endpoint="http://127.0.0.1:1", **cfg), count)
    ex.start()
    ex._otlp = fake  # the SDK's conversion stays; the wire is the fake's
    return ex


def _traced_request(tracer: tracing.Tracer) -> tracing.Trace:
    tr, _, _ = tracer.begin(TP + "", "rojo=00f067aa0ba902b7", "POST", "/v1/chat/completions")
    assert tr is not None
    adm = tr.current = tr.span("admission")
    tr.end(adm)
    tr.current = tr.root
    pre = tr.span("prefill", tracing.CLIENT, {"server.port": 8000})
    tr.end(pre, "prefill_timeout")
    tr.fallback("prefill_timeout")
    fb = tr.current = tr.span("fallback", attrs={"pd.fallback.reason": "prefill_timeout"})
    dec = tr.span("decode", tracing.CLIENT)
    tr.answer = dec
    tr.end(fb)
    tr.close({"http.response.status_code": 200}, "", time.perf_counter())
    return tr


def test_spans_reach_the_exporter_as_the_sdks_spans_nested_and_described() -> None:
    counts: dict[str, int] = {}
    fake = FakeOtlp()
    ex = _exporter(fake, counts, service_name="r1")
    tracer = tracing.Tracer(Tracing(endpoint="http://x:4317"), _no_count)
    tracer.exporter = ex
    tr = _traced_request(tracer)
    tracer.submit(tr)
    ex.stop(10)  # what is queued goes out at stop
    assert fake.shut
    (spans,) = fake.batches
    assert counts == {"exported": 5}
    by = {s.name: s for s in spans}
    root = by["POST /v1/chat/completions"]
    assert root.kind == api.SpanKind.SERVER
    assert root.parent.span_id == 0xB7AD6B7169203331 and root.parent.is_remote
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert root.context.trace_state.to_header() == "rojo=00f067aa0ba902b7"
    assert root.resource.attributes["service.name"] == "r1"
    assert root.instrumentation_scope.name == "pd_router"
    assert [e.name for e in root.events] == ["fallback"]
    for name in ("admission", "prefill", "fallback"):
        assert by[name].parent.span_id == root.context.span_id
        assert not by[name].parent.is_remote
    assert by["decode"].parent.span_id == by["fallback"].context.span_id
    assert by["prefill"].kind == api.SpanKind.CLIENT
    assert by["prefill"].status.status_code == api.StatusCode.ERROR
    assert by["prefill"].status.description == "prefill_timeout"
    assert [e.name for e in by["decode"].events] == ["first_token"]
    assert by["decode"].attributes["pd.ttft_ms"] >= 0
    for s in spans:
        assert s.context.trace_flags.sampled
        assert 0 < s.start_time <= s.end_time


def test_a_full_queue_drops_and_counts_and_the_thread_catches_up() -> None:
    counts: dict[str, int] = {}
    gate = threading.Event()
    fake = FakeOtlp(block=gate)
    ex = _exporter(fake, counts)
    tracer = tracing.Tracer(Tracing(endpoint="http://x:4317"), _no_count)
    first = _traced_request(tracer)
    ex.put(first)
    ex._wake.set()
    assert fake.entered.wait(30)  # the thread holds the first batch: fill the queue behind it
    for _ in range(ex.QUEUE + 5):
        ex.put(_traced_request(tracer))
    assert counts.get("dropped") == 5 * 5
    gate.set()
    ex.stop(30)
    assert counts["exported"] == (ex.QUEUE + 1) * 5


def test_a_failed_export_is_counted_not_raised() -> None:
    counts: dict[str, int] = {}
    ex = _exporter(FakeOtlp(result=SpanExportResult.FAILURE), counts)
    tracer = tracing.Tracer(Tracing(endpoint="http://x:4317"), _no_count)
    ex.put(_traced_request(tracer))
    ex.stop(10)
    assert counts == {"failed": 5}


def test_headers_file(tmp_path: Path) -> None:
    f = tmp_path / "headers"
    f.write_text("x-api-key=s3cr%3Dt, X-Team = infra\n")
    assert tracing.read_headers(str(f)) == {"x-api-key": "s3cr=t", "x-team": "infra"}
    f.write_text("")
    assert tracing.read_headers(str(f)) == {}
    f.write_text("x-api-key=ok,not a header")
    with pytest.raises(ValueError) as e:
        tracing.read_headers(str(f))
    assert "tracing.headersFile: entry 2" in str(e.value) and "not a header" not in str(e.value)
    with pytest.raises(ValueError, match=r"tracing\.headersFile: cannot read"):
        tracing.read_headers(str(tmp_path / "missing"))
