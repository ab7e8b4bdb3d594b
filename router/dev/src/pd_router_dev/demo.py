"""``make demo``: one simulated prefill engine, one simulated decode engine and the router on
loopback; three chat requests through the official ``openai`` client: a short one, a long one
and the long one's next turn (served by the decoder that holds it). ``--trace`` also runs the
OpenTelemetry Collector (built by ``make tools``), has the router trace every request and prints
each request's trace as the collector received it.

The router is configured from ``demo-config.yaml`` through the same loader as the chart's
ConfigMap; the engines' ports (and ``--port``/``--model``) are filled in with ``PD_ROUTER__*``
env overrides. The processes' logs are kept in a folder the demo prints (``--logs`` picks it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pd_router.config import load_config
from pd_router_dev.devstack import DEMO_CONFIG, Proc, Stack, free_port
from pd_router_dev.sim import kv_events

# The chart's defaults (charts/pd-inference/values.yaml model.servedName, kvTransfer.connector;
# router/tests/test_router_cli_demo.py checks they agree): what a default install runs.
MODEL = "qwen3.5-9b"
CONNECTOR = "nixl"
LONG_DOC = (
    "Disaggregated serving splits the compute-bound prefill of a long prompt from the "
    "memory-bound decode of its answer, so long prompts stop stalling other users' streams. "
) * 60


def _ask(
    client: object, model: str, content: str, headers: dict[str, str] | None = None
) -> tuple[str, str, str, float, float]:
    t0 = time.perf_counter()
    ttft = 0.0
    parts: list[str] = []
    with client.chat.completions.with_streaming_response.create(  # type: ignore[attr-defined]
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_headers=headers or {},
    ) as resp:
        route = resp.headers.get("x-pd-route", "?")
        reason = resp.headers.get("x-pd-reason", "?")
        for chunk in resp.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if not ttft:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
    return "".join(parts), route, reason, ttft, time.perf_counter() - t0


def _print_trace(spans: list[dict[str, Any]]) -> None:
    """A trace as an indented tree: each span's duration and what the router says of it."""
    by_parent: dict[str, list[dict[str, Any]]] = {}
    ids = {s["spanId"] for s in spans}
    for s in spans:
        parent = s.get("parentSpanId", "")
        by_parent.setdefault(parent if parent in ids else "", []).append(s)

    def show(s: dict[str, Any], depth: int) -> None:
        ms = (int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"])) / 1e6
        said = {
            k.removeprefix("pd."): v
            for k, v in s["attrs"].items()
            if k in ("pd.route", "pd.reason", "pd.ttft_ms", "pd.prompt_tokens", "pd.engine")
            or k.startswith("pd.decision.")
        }
        detail = " ".join(f"{k}={v}" for k, v in said.items())
        print(f"  {'  ' * depth}{s['name']:<{34 - 2 * depth}} {ms:8.1f} ms  {detail}")
        for c in sorted(by_parent.get(s["spanId"], []), key=lambda c: int(c["startTimeUnixNano"])):
            show(c, depth + 1)

    for root in by_parent.get("", []):
        show(root, 0)


def _kv_events() -> list[str]:
    """vLLM's --kv-events-config for one simulated engine, on ports of its own."""
    return ["--kv-events-config", kv_events.config_json(free_port(), free_port())]


def _sim_with_events(stack: Stack, name: str, *args: str) -> Proc:
    """A simulated engine publishing its KV-cache events on free ports, tried again on other
    ports (at most 3 times) when one was taken between the pick and the bind: the publisher
    binds every address, and on a busy machine (make test's other worker) a port free on
    127.0.0.1 a moment ago can be gone. The router learns the ports from the engine."""
    for attempt in range(3):
        try:
            return stack.sim(name, *args, *_kv_events())
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pd_router_dev.demo", description=__doc__)
    p.add_argument("--once", action="store_true", help="exit after the three requests")
    p.add_argument("--connector", choices=["lmcache", "nixl"], default=CONNECTOR)
    p.add_argument("--port", type=int, default=0, help="router port on 127.0.0.1 (0 = a free one)")
    p.add_argument("--model", default=MODEL, help="model name the engines serve and clients send")
    p.add_argument("--logs", help="folder for the processes' logs (default: a new one in /tmp)")
    p.add_argument(
        "--api-key",
        help="run the router with this API key (router.auth) and ask with it; default: no keys",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace every request to the OpenTelemetry Collector (make tools builds it) and "
        "print each trace",
    )
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"--port: must be between 0 and 65535, got {a.port}")

    notify, init_port, alloc_port = free_port(), free_port(), free_port()
    timing = [
        "--prefill-ms-per-token",
        "0.3",
        "--decode-step-ms",
        "15",
        "--decode-step-ms-per-seq",
        "1",
    ]
    env = {
        "PD_ROUTER__LISTEN__PORT": str(a.port),
        "PD_ROUTER__MODEL__SERVEDNAME": a.model,
        "PD_ROUTER__ROUTING__CONNECTOR": a.connector,
        "PD_ROUTER__LMCACHE__NOTIFYPORT": str(notify),
        "PD_ROUTER__LMCACHE__DECODERINITPORTS": f"[{init_port}]",
        "PD_ROUTER__LMCACHE__DECODERALLOCPORTS": f"[{alloc_port}]",
    }
    logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="pd-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    if a.api_key:  # the keys file the chart mounts from router.auth.existingSecret
        (logs / "api-keys").write_text(a.api_key + "\n")
        env["PD_ROUTER__AUTH__APIKEYSFILE"] = str(logs / "api-keys")
    collector = None
    if a.trace:
        from pd_router_dev import otelcol

        try:
            collector = otelcol.Collector(logs, "demo-otelcol")
        except RuntimeError as exc:
            p.error(f"--trace: {exc}")
        env["PD_ROUTER__TRACING__ENDPOINT"] = collector.grpc
        env["PD_ROUTER__TRACING__SAMPLINGRATIO"] = "1"
    try:
        return _run(a, env, logs, collector, notify, init_port, alloc_port, timing)
    finally:
        if collector is not None:
            collector.stop()


def _run(
    a: argparse.Namespace,
    env: dict[str, str],
    logs: Path,
    collector: Any,
    notify: int,
    init_port: int,
    alloc_port: int,
    timing: list[str],
) -> int:
    import openai

    with Stack(logs) as stack:  # a folder given to Stack is left in place: the logs stay
        stop = {"now": False}

        def _sig(*_: object) -> None:
            stop["now"] = True

        signal.signal(signal.SIGTERM, _sig)
        if a.connector == "lmcache":
            pre_args = [
                "--kv-connector",
                "lmcache",
                "--lmcache-role",
                "sender",
                "--pd-proxy-port",
                str(notify),
            ]
            dec_args = [
                "--kv-connector",
                "lmcache",
                "--lmcache-role",
                "receiver",
                "--pd-peer-init-port",
                str(init_port),
                "--pd-peer-alloc-port",
                str(alloc_port),
            ]
        else:
            pre_args = dec_args = ["--kv-connector", "nixl"]
        model = ["--model", a.model]
        # both engines publish their KV-cache events, as the chart renders them (own ports here:
        # they share this host); the router routes on what they hold
        env["PD_ROUTER__ROUTING__KVEVENTS__PORT"] = "0"
        env["PD_ROUTER__ROUTING__KVEVENTS__REPLAYPORT"] = "0"
        prefill = _sim_with_events(stack, "demo-prefill", *pre_args, *timing, *model)
        decode = _sim_with_events(stack, "demo-decode", *dec_args, *timing, *model)
        env["PD_ROUTER__POOLS__PREFILL__STATIC"] = f"[{prefill.url()}]"
        env["PD_ROUTER__POOLS__DECODE__STATIC"] = f"[{decode.url()}]"
        cfg = load_config(DEMO_CONFIG, env)  # fail here, clearly, on a bad demo config
        router = stack.router("demo-router", DEMO_CONFIG, env)
        print(
            "engines are simulated (pd_router_dev.sim: vLLM's API, metrics and hand-offs, no model)"
        )
        print(f"prefill engine  {prefill.url()}  (pid {prefill.pid})")
        print(f"decode engine   {decode.url()}  (pid {decode.pid})")
        print(
            f"router          {router.url()}  (pid {router.pid}) connector={a.connector} "
            f"threshold={cfg.routing.threshold} tokens"
        )
        print(f"model           {cfg.model.served_name}  (clients send this as `model`)")
        key = a.api_key or "none"  # the openai client insists on one; an open router ignores it
        client = openai.OpenAI(base_url=router.url() + "/v1", api_key=key, max_retries=0)
        long = LONG_DOC + "\nSummarise the text above."
        for label, content in (
            ("short", "What is disaggregated serving?"),
            ("long", long),
            # the decoder that received the long prompt's KV holds it: no prefill leg again
            ("next-turn", long + "\nNow in one sentence."),
        ):
            tid = uuid.uuid4().hex
            headers = {"traceparent": f"00-{tid}-{uuid.uuid4().hex[:16]}-01"} if collector else {}
            answer, route, reason, ttft, total = _ask(
                client, cfg.model.served_name, content, headers
            )
            print(
                f"\n[{label} request: {len(content)} chars] route={route} reason={reason} "
                f"TTFT={ttft * 1000:.0f} ms total={total * 1000:.0f} ms"
            )
            print(f"  answer: {answer.strip()}")
            if collector is not None:  # the router exports within a second or so
                spans = collector.trace(
                    tid,
                    lambda sp: any(s["name"].startswith("POST ") for s in sp),
                    "its request span",
                )
                print(f"  trace {tid} (as the collector received it):")
                _print_trace(spans)
        if a.once:
            print(f"\nlogs (kept): {logs}")
            return 0
        print(f"\nmetrics: {router.url()}/metrics   logs (kept): {logs}")
        print(f"try: curl -s {router.url()}/v1/models")
        print("stack is up; Ctrl-C to stop")
        try:
            while not stop["now"]:
                for proc in stack.procs:
                    if proc.popen.poll() is not None:
                        print(f"{proc.name} exited:\n{proc.log_tail()}", file=sys.stderr)
                        return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        print(f"\nstopping (logs kept in {logs})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
