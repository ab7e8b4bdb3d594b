"""The real OpenTelemetry Collector on loopback, for the tracing tests, the real-engine tier,
``make demo --trace`` and ``make bench``.

The collector is the one ``scripts/install-tools.sh otelcol`` builds with the collector's own
builder from Go modules (pinned in scripts/tools.env): its OTLP receiver (gRPC and HTTP, as a
cluster's collector runs it) and, behind it, the contrib file exporter writing each batch it
receives as one JSON line in OTLP's JSON encoding (``keep=True``), or the nop exporter (make
bench: the collector's work is not what is measured). Why this receiver and not another: it is
what platform teams run in front of Tempo, Jaeger or a vendor, so what it accepts is what
reaches them; and a test written against its file output reads OTLP as the collector decoded
it, not as our own code would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pd_router_dev.devstack import Proc, free_port, pinned

READY_SECONDS = 60


def binary() -> Path:
    """The collector built by ``scripts/install-tools.sh otelcol`` (``make tools``), linked
    next to this interpreter (the build's folder is pinned in scripts/tools.env, which this
    package does not read); ``PD_OTELCOL`` names another."""
    named = os.environ.get("PD_OTELCOL")
    if named:
        return Path(named)
    return Path(sys.executable).with_name("otelcol-pd")


class Collector:
    """One collector process: ``grpc`` and ``http`` are its OTLP endpoints (as the router's
    ``tracing.endpoint`` takes them), ``spans()`` what it has written."""

    def __init__(
        self,
        workdir: Path,
        name: str = "otelcol",
        keep: bool = True,
        cpus: list[int] | None = None,
    ) -> None:
        exe = binary()
        if not exe.exists():
            raise RuntimeError(f"the OpenTelemetry Collector is not built at {exe}: run make tools")
        self.workdir = workdir
        self.out = workdir / f"{name}-spans.jsonl"
        self.log = workdir / f"{name}.log"
        gport, hport = free_port(), free_port()
        self.grpc = f"http://127.0.0.1:{gport}"
        self.http = f"http://127.0.0.1:{hport}"
        exporter = (
            {"file": {"path": str(self.out), "flush_interval": "100ms"}} if keep else {"nop": {}}
        )
        cfg = {
            "receivers": {
                "otlp": {
                    "protocols": {
                        "grpc": {"endpoint": f"127.0.0.1:{gport}"},
                        "http": {"endpoint": f"127.0.0.1:{hport}"},
                    }
                }
            },
            "exporters": exporter,
            "service": {
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
                "pipelines": {
                    "traces": {"receivers": ["otlp"], "exporters": list(exporter)},
                },
            },
        }
        cfg_path = workdir / f"{name}.yaml"
        cfg_path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
        with open(self.log, "wb") as log:
            popen = subprocess.Popen(
                [str(exe), "--config", str(cfg_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=pinned(cpus),  # noqa: PLW1509 - sched_setaffinity only
            )
        self.proc = Proc(name, popen, self.log, gport)
        self._wait_listening(gport, hport)

    def _wait_listening(self, *ports: int) -> None:
        end = time.monotonic() + READY_SECONDS
        for port in ports:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if self.proc.popen.poll() is not None or time.monotonic() > end:
                        self.stop()
                        tail = self.proc.log_tail(2000)
                        raise RuntimeError(
                            f"the collector did not listen on {port}: {tail}"
                        ) from None
                    time.sleep(0.05)

    def spans(self) -> list[dict[str, Any]]:
        """Every span written so far, flattened: the OTLP JSON span plus ``service`` (its
        resource's service.name) and ``attrs`` (attributes as a plain dict)."""
        try:
            text = self.out.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            for rs in batch.get("resourceSpans", []):
                res = _attrs(rs.get("resource", {}).get("attributes", []))
                for ss in rs.get("scopeSpans", []):
                    for sp in ss.get("spans", []):
                        sp["service"] = res.get("service.name", "")
                        sp["resource"] = res
                        sp["scope"] = ss.get("scope", {}).get("name", "")
                        sp["attrs"] = _attrs(sp.get("attributes", []))
                        out.append(sp)
        return out

    def trace(
        self, trace_id: str, until: Any, what: str, deadline_s: float = 60
    ) -> list[dict[str, Any]]:
        """The spans of ``trace_id`` once ``until(spans)`` holds (exporters batch: spans arrive
        a second or so after the request). The deadline only stops a broken test."""
        end = time.monotonic() + deadline_s
        while True:
            spans = [s for s in self.spans() if s["traceId"] == trace_id]
            if until(spans):
                return spans
            if time.monotonic() > end:
                names = sorted(f"{s['service']}:{s['name']}" for s in spans)
                raise AssertionError(f"trace {trace_id}: never {what}; has {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.stop()


def _attrs(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    """OTLP JSON attributes (``{"key", "value": {"stringValue": ...}}``) as a dict."""
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.get("value", {})
        if "stringValue" in v:
            out[kv["key"]] = v["stringValue"]
        elif "intValue" in v:
            out[kv["key"]] = int(v["intValue"])
        elif "doubleValue" in v:
            out[kv["key"]] = float(v["doubleValue"])
        elif "boolValue" in v:
            out[kv["key"]] = bool(v["boolValue"])
        else:
            out[kv["key"]] = v
    return out
