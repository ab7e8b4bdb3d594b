"""OpenTelemetry traces of the router's requests (``tracing`` in the config; off when its
``endpoint`` is empty).

One trace per sampled request, continuing the client's W3C ``traceparent`` when it sends one::

    POST /v1/chat/completions      SERVER  route, reason, outcome, status, TTFT, fallback reason
    ├── admission                  INTERNAL  auth, body read, queue wait
    ├── decision                   INTERNAL  decided route and reason, prompt and cached tokens
    │   └── tokenize               CLIENT  an engine's /tokenize, when the router has no tokenizer
    ├── prefill                    CLIENT  the prefill leg (vLLM's own span below it)
    ├── kv_handoff_wait            INTERNAL  LMCache: until the prefillers' notifications landed
    ├── fallback                   INTERNAL  the hand-off could not serve it: one decoder does
    │   └── decode                 CLIENT
    └── decode                     CLIENT  one per decoder tried; the answering one carries the
                                           first token (event) and TTFT

Every engine call carries its own span's ``traceparent`` (and the client's ``tracestate``), so
the spans vLLM exports with ``--otlp-traces-endpoint`` nest under the leg that caused them. A
request not sampled still carries one (flag 00) so that the engines, sampling parent-based,
skip it too; with tracing off the client's own headers pass through unchanged.

Why a request's spans are plain records here and become the SDK's spans only in the export
thread: on this project's 2-core machine the SDK's tracer API (``start_span``/``end``, five spans,
ParentBased(TraceIdRatioBased), BatchSpanProcessor, an exporter that does nothing) took 320 µs
per request, 71 µs sampled out: several times the router's own work per request (about 90 µs,
docs/benchmarks.md). Here a sampled request's spans cost a few µs on the event loop, one not
sampled one ``traceparent`` line; the export thread (:class:`Exporter`) turns them into the SDK's
``ReadableSpan`` objects and hands them in batches to the SDK's OTLP exporter (gRPC or
HTTP/protobuf), off the request path. The sampler and the W3C header rules are the SDK's,
written again for that speed: ``router/tests/unit/test_tracing.py`` checks them against
``ParentBased(TraceIdRatioBased)`` and ``TraceContextTextMapPropagator`` of the pinned SDK
(opentelemetry-sdk 1.45.2). The SDK is imported only when tracing is on.
"""

from __future__ import annotations

import collections
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from pd_router.config import Tracing

log = logging.getLogger("pd_router.tracing")

# Span kinds (opentelemetry.trace.SpanKind values, named here so the request path imports no SDK)
INTERNAL, SERVER, CLIENT = "internal", "server", "client"
# OTLP/HTTP's path for traces, appended to a base endpoint (OTel specification, "OpenTelemetry
# Protocol Exporter": OTEL_EXPORTER_OTLP_ENDPOINT + "v1/traces"); the chart appends it for vLLM
TRACES_PATH = "/v1/traces"
SCOPE = "pd_router"

# W3C Trace Context level 1, as opentelemetry-api 1.45.2 reads it
# (trace/propagation/tracecontext.py, trace/span.py)
_TRACEPARENT_RE = re.compile(
    r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)"
)
_TRACEPARENT_MAX = 512
_TS_MEMBER_RE = re.compile(
    r"([a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13})"
    r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])"
)
_TS_MAX_LEN = 8192
_TS_MAX_KEYS = 32
_ID_LIMIT = (1 << 64) - 1  # TraceIdRatioBased reads the trace id's low 64 bits

_rand = random.Random()


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a valid ``traceparent``, else None (the header is
    then ignored, as the SDK's propagator does)."""
    if not value or len(value) > _TRACEPARENT_MAX:
        return None
    m = _TRACEPARENT_RE.fullmatch(value)
    if m is None:
        return None
    version, tid, sid, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(tid, 16), int(sid, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags, 16)


def parse_tracestate(value: str | None) -> str:
    """The ``tracestate`` to pass on: the client's members, comma-joined, or "" when it sent
    none or one the SDK would discard whole (a malformed member, a key twice, too long)."""
    if not value or len(value) > _TS_MAX_LEN:
        return ""
    keys: set[str] = set()
    members = []
    for raw in value.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        m = _TS_MEMBER_RE.fullmatch(member)
        if m is None or m.group(1) in keys:
            return ""
        keys.add(m.group(1))
        members.append(member)
    if len(members) > _TS_MAX_KEYS:
        return ""
    return ",".join(members)


def _traceparent(trace_id: int, span_id: int, flags: int) -> bytes:
    return b"traceparent: 00-%032x-%016x-%02x\r\n" % (trace_id, span_id, flags)


def _state_header(state: str) -> bytes:
    return b"tracestate: %s\r\n" % state.encode() if state else b""


def forward(traceparent: str, tracestate: str | None) -> tuple[bytes, str]:
    """Tracing off: the client's trace headers as the engines get them (upstream header
    lines, b"" when not valid) and its trace id for the access log."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return b"", ""
    trace_id, span_id, flags = parsed
    return (
        _traceparent(trace_id, span_id, flags) + _state_header(parse_tracestate(tracestate)),
        f"{trace_id:032x}",
    )


def _new_id(bits: int) -> int:
    while True:  # zero is the invalid id
        v = _rand.getrandbits(bits)
        if v:
            return v


class Span:
    """One span, as the request path records it (nanoseconds since the epoch)."""

    __slots__ = ("attrs", "end", "error", "events", "kind", "name", "parent", "span_id", "start")

    def __init__(self, name: str, kind: str, parent: int, attrs: dict[str, Any] | None) -> None:
        self.name = name
        self.kind = kind
        self.parent = parent  # 0: the trace's root, started here
        self.span_id = _new_id(64)
        self.start = time.time_ns()
        self.end = 0
        self.attrs: dict[str, Any] = attrs if attrs is not None else {}
        self.events: list[tuple[str, int, dict[str, Any]]] | None = None
        self.error = ""  # set: the span's status is ERROR with this description


class Trace:
    """A sampled request's spans. Spans start under ``current`` (the root, or the span a stage
    makes current while it runs); whatever is still open when the request ends ends then."""

    __slots__ = ("answer", "current", "root", "spans", "state", "t0", "trace_id")

    def __init__(self, trace_id: int, state: str, root: Span) -> None:
        self.trace_id = trace_id
        self.state = state
        self.root = root
        self.current = root
        self.spans = [root]
        self.answer: Span | None = None  # the decode span whose answer the client got
        self.t0 = time.perf_counter()  # with root.start: a perf_counter time's wall-clock time

    def span(self, name: str, kind: str = INTERNAL, attrs: dict[str, Any] | None = None) -> Span:
        s = Span(name, kind, self.current.span_id, attrs)
        self.spans.append(s)
        return s

    @staticmethod
    def end(span: Span, error: str = "") -> None:
        if not span.end:
            span.end = time.time_ns()
            if error:
                span.error = error

    def headers(self, base: bytes, span: Span) -> bytes:
        """``base`` plus the trace context of ``span``: what an engine call made under it
        sends."""
        return base + _traceparent(self.trace_id, span.span_id, 1) + _state_header(self.state)

    def event(self, span: Span, name: str, attrs: dict[str, Any], at: int = 0) -> None:
        if span.events is None:
            span.events = []
        span.events.append((name, at or time.time_ns(), attrs))

    def fallback(self, reason: str) -> None:
        """The request is served another way than decided (request.Outcomes.fallback)."""
        self.root.attrs["pd.fallback.reason"] = reason
        self.event(self.root, "fallback", {"pd.fallback.reason": reason})

    def close(self, attrs: dict[str, Any], error: str, t_first: float) -> None:
        """End the request: the root gets ``attrs`` (and ERROR status when ``error``), the
        answering decode span the first token's time (``t_first``, perf_counter; 0: none
        reached the client), every span still open ends now."""
        now = time.time_ns()
        root = self.root
        root.attrs.update(attrs)
        if t_first:
            at = root.start + int((t_first - self.t0) * 1e9)
            ttft = round((t_first - self.t0) * 1000, 3)
            root.attrs["pd.ttft_ms"] = ttft
            if self.answer is not None:
                self.answer.attrs["pd.ttft_ms"] = ttft
                self.event(self.answer, "first_token", {}, at)
        for s in self.spans:
            if not s.end:
                s.end = now
        if error:
            root.error = error


class Tracer:
    """The sampler, the traces it starts, and their export (one per router process)."""

    def __init__(self, cfg: Tracing, count: Callable[[str, int], None]) -> None:
        self.cfg = cfg
        # TraceIdRatioBased: sampled when the trace id's low 64 bits are below this
        self._bound = round(cfg.sampling_ratio * (_ID_LIMIT + 1))
        self.exporter = Exporter(cfg, count)

    def begin(
        self, traceparent: str | None, tracestate: str | None, method: str, path: str
    ) -> tuple[Trace | None, bytes, str]:
        """A request arrived: (its trace when sampled, else None; the trace header lines its
        engine calls carry when not sampled; its trace id). ParentBased(TraceIdRatioBased): a
        valid incoming ``traceparent`` decides by its sampled flag, else the ratio does."""
        parsed = parse_traceparent(traceparent) if traceparent else None
        if parsed is None:
            trace_id, parent, state = _new_id(128), 0, ""
            sampled = (trace_id & _ID_LIMIT) < self._bound
            flags = 1 if sampled else 0
        else:
            trace_id, parent, flags = parsed
            state = parse_tracestate(tracestate)
            sampled = bool(flags & 1)
        tid = f"{trace_id:032x}"
        if not sampled:
            # the client's parent passes on unchanged; without one, a trace nobody records
            span_id = parent or _new_id(64)
            return None, _traceparent(trace_id, span_id, flags) + _state_header(state), tid
        # HTTP server span: named and described as OTel's HTTP semantic conventions say
        attrs = {"http.request.method": method, "http.route": path, "url.path": path}
        return Trace(trace_id, state, Span(f"{method} {path}", SERVER, parent, attrs)), b"", tid

    def submit(self, trace: Trace) -> None:
        self.exporter.put(trace)

    def start(self) -> None:
        self.exporter.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.exporter.stop(timeout)


class Exporter:
    """A bounded queue of ended traces and the thread that exports them with the OpenTelemetry
    SDK's OTLP exporter: every ``delay`` seconds, or sooner once ``batch`` traces wait. A full
    queue drops the newest trace (counted), so a slow or absent collector costs the request
    path nothing but that count; at stop, what is queued goes out within the stop's timeout.

    ``count(outcome, spans)``: spans ``exported``, ``failed`` (the exporter gave up on them) or
    ``dropped`` (the queue was full)."""

    QUEUE = 2048  # traces (a request's 4 to 8 spans each)
    BATCH = 128  # traces per export call at most, and how many wake the thread early
    DELAY = 1.0  # seconds between exports otherwise (the SDK's BatchSpanProcessor waits 5)

    def __init__(self, cfg: Tracing, count: Callable[[str, int], None]) -> None:
        self.cfg = cfg
        self.count = count
        self._q: collections.deque[Trace] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._otlp: Any = None  # the SDK's exporter, made in start()
        self._sdk: Any = None

    def put(self, trace: Trace) -> None:
        q = self._q
        if len(q) >= self.QUEUE or self._stopping:
            self.count("dropped", len(trace.spans))
            return
        q.append(trace)  # atomic under the GIL; the thread pops from the other end
        if len(q) >= self.BATCH and not self._wake.is_set():
            self._wake.set()

    def start(self) -> None:
        self._sdk = _Sdk(self.cfg)
        self._otlp = self._sdk.exporter()
        self._thread = threading.Thread(target=self._run, name="pd-router-otlp", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # still exporting: what it holds is lost with the process
            log.warning("tracing: spans still queued at shutdown were not exported")
        self._otlp.shutdown()
        self._thread = None

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.DELAY)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        q = self._q
        while q:
            batch = [q.popleft() for _ in range(min(self.BATCH, len(q)))]
            spans = [s for t in batch for s in self._sdk.spans(t)]
            try:
                ok = self._otlp.export(spans) == self._sdk.SUCCESS
            except Exception:  # an exporter bug must not end the thread (the SDK's rule too)
                log.exception("tracing: the OTLP exporter failed")
                ok = False
            self.count("exported" if ok else "failed", len(spans))


class _Sdk:
    """The OpenTelemetry SDK, imported when tracing is on: the OTLP exporter of the configured
    protocol and the conversion of a :class:`Trace` into its ``ReadableSpan`` objects."""

    def __init__(self, cfg: Tracing) -> None:
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from pd_router import __version__

        self.cfg = cfg
        self.api = api
        self.Event = Event
        self.ReadableSpan = ReadableSpan
        self.SUCCESS = SpanExportResult.SUCCESS
        # OTEL_RESOURCE_ATTRIBUTES (the chart: namespace, pod) joins, as Resource.create reads it
        res = Resource.create({SERVICE_NAME: cfg.service_name})

        class OneResource(Resource):
            """The SDK's encoder groups spans by resource, hashing it per span, which
            serialises its attributes to JSON each time (14 % of the encoder's time, measured):
            every span here has this one resource, so its hash is computed once."""

            _hash = hash(res)

            def __hash__(self) -> int:
                return self._hash

        self.resource = OneResource(res.attributes, res.schema_url)
        self.scope = InstrumentationScope(SCOPE, __version__)
        self.kinds = {
            INTERNAL: api.SpanKind.INTERNAL,
            SERVER: api.SpanKind.SERVER,
            CLIENT: api.SpanKind.CLIENT,
        }
        self.unset = api.Status(api.StatusCode.UNSET)
        self.sampled = api.TraceFlags(api.TraceFlags.SAMPLED)

    def exporter(self) -> Any:
        cfg = self.cfg
        headers = read_headers(cfg.headers_file) if cfg.headers_file else None
        if cfg.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # http:// is plaintext, https:// TLS (the exporter reads the scheme)
            return OTLPSpanExporter(
                endpoint=cfg.endpoint, headers=headers, timeout=cfg.timeout_seconds
            )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(
            endpoint=cfg.endpoint.rstrip("/") + TRACES_PATH,
            headers=headers,
            timeout=cfg.timeout_seconds,
        )

    def spans(self, t: Trace) -> list[Any]:
        api = self.api
        state = api.TraceState.from_header([t.state]) if t.state else None
        out = []
        for s in t.spans:
            ctx = api.SpanContext(t.trace_id, s.span_id, False, self.sampled, state)
            parent = None
            if s.parent:  # the root's parent is the client's span (remote)
                parent = api.SpanContext(t.trace_id, s.parent, s is t.root, self.sampled, state)
            status = api.Status(api.StatusCode.ERROR, s.error) if s.error else self.unset
            events = ()
            if s.events:
                events = tuple(self.Event(n, a, at) for n, at, a in s.events)
            out.append(
                self.ReadableSpan(
                    s.name,
                    context=ctx,
                    parent=parent,
                    resource=self.resource,
                    attributes=s.attrs,
                    events=events,
                    kind=self.kinds[s.kind],
                    status=status,
                    start_time=s.start,
                    end_time=s.end,
                    instrumentation_scope=self.scope,
                )
            )
        return out


_HEADER_NAME_RE = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token (RFC 9110)


def read_headers(path: str) -> dict[str, str]:
    """The OTLP headers in ``path`` (a mounted Secret): ``key=value`` pairs, comma-separated,
    values URL-encoded, as ``OTEL_EXPORTER_OTLP_HEADERS`` takes them. Not the SDK's parser:
    it logs a malformed entry whole, and these hold credentials. Raises ValueError naming the
    field and the entry's position, never its content."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as exc:
        raise ValueError(f"tracing.headersFile: cannot read {path}: {exc.strerror}") from None
    headers: dict[str, str] = {}
    for i, entry in enumerate(text.split(",") if text else []):
        if not entry.strip():
            continue
        name, eq, value = entry.partition("=")
        name = unquote(name).strip().lower()
        if not eq or not _HEADER_NAME_RE.fullmatch(name):
            raise ValueError(
                f"tracing.headersFile: entry {i + 1} of {path} is not name=value with an HTTP "
                "header name (OTEL_EXPORTER_OTLP_HEADERS form)"
            )
        value = unquote(value).strip()
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"tracing.headersFile: entry {i + 1} of {path} has a line break")
        headers[name] = value
    return headers
