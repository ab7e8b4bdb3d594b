"""``make bench``: our router against the Rust ``vllm-router`` 0.1.17 (PyPI) and against the
engine directly, one run, plus a mixed-traffic and a multi-turn chat scenario on simulated
engines that take time (``pd_router_dev.mixed``, ``pd_router_dev.multiturn``) and what the
routing decision costs, measured in this process (``pd_router_dev.decision_cost``).

Throughput matrix (every cell the same chat completions body, 16 output tokens, at each client
concurrency; not streamed, streamed with the engine writing each stream at once, and streamed
with one engine write per token 5 ms apart, as tokens come from a real engine):

- the engine directly: ``fastengine`` (Go, router/dev/fastengine), a zero-delay engine fast
  enough that it and the load generator are never what is measured (its figure is shown: it
  must be at least 3x the fastest router's);
- our router's direct route vs ``vllm-router`` in its regular mode, on the same engine;
- our router's NIXL route vs ``vllm-router --vllm-pd-disaggregation``, same prefill and decode
  engines, round robin both;
- our router's LMCache route (``notificationReceiver: prefillSidecar``, the engine answering
  the sidecar's wait at once);
- our direct route again with ``logging.level: info`` (the default: one JSON access line per
  request) against ``warning``, which the other rows use, to show what the line costs;
- our direct and NIXL routes with tracing on (``tracing.samplingRatio`` 1: every request's spans
  exported over OTLP/gRPC to the real OpenTelemetry Collector, pd_router_dev.otelcol, which
  drops them), and the NIXL route with tracing on but nothing sampled (ratio 0: only the
  ``traceparent`` the legs carry), against the same routes with tracing off, the default.

Each router process is pinned to the same CPU set (``--router-cpus``; the engine and the load
generator get the others), our router started with ``listen.workers`` = that many CPUs. Every
cell is measured ``--rounds`` times, the targets in turn (reversed every other round), and
the best round counts: whatever else runs on the machine only ever lowers a figure.
Reported per cell: requests/s, latency p50/p99 and what the router adds over the engine,
TTFT for streams, router CPU per request (utime+stime of the router and its children, from
/proc), how many cores it kept busy, and its RSS under load (the sum over its processes);
then the ratios ours / vllm-router against the targets of issue 15. One JSON line per cell
and round goes next to the markdown table (``--out x.md`` also writes ``x.jsonl``).

Multi-turn chat (issue 13): chat sessions whose later turns resend a growing context, with
unrelated long prompts and short requests, at the same engine count: 2 colocated engines vs
1 prefill + 1 decode with ``routing.decision: length`` vs ``decision: prefix``; TTFT (later
turns apart), ITL, the prefiller's busy seconds, KV tokens moved and the ``x-pd-reason``
headers seen, then prefix / length against issue 13's targets. The decision's cost (issue
15): the event loop's blocked time and CPU and the process's CPU per decision of an
8,000-token chat prompt, far from the threshold (sampled estimate) and near it (exact count
in a thread), both decisions, against 1 ms on the loop and 2 ms of CPU. Last, where our router's
CPU goes (``pd_router_dev.profile``): py-spy samples our direct and NIXL routes under the
matrix's load (32 clients, not streamed), each sample charged to its owner (our HTTP
server, the event loop, our handler chain, the upstream client, metrics, logging); the raw stacks
are kept next to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pd_router_dev import (
    decision_cost,
    fastengine,
    goodput_cost,
    kv_events_cost,
    mixed,
    multiturn,
    otelcol,
    profile,
)
from pd_router_dev.devstack import (
    DEMO_CONFIG,
    Proc,
    Stack,
    free_port,
    pinned,
    static_pools,
    vllm_router_binary,
    vllm_router_command,
    vllm_router_regular_command,
)

MODEL = "llama-3.3-70b"
PROMPT = "Explain in one paragraph why long prompts should be prefilled on separate engines."
MAX_TOKENS = 16
CLK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

# issue 15's targets, ours / vllm-router
CPU_TARGET = 0.8  # CPU per request at most
RPS_TARGET = 1.2  # requests/s at least
ADDED_P50_TARGET = 1.0  # added p50 latency at c=1 at most
LMCACHE_RPS_TARGET = 0.8  # LMCache route / NIXL route, requests/s at least
LMCACHE_CPU_TARGET = 1.2  # and CPU per request at most
ENGINE_HEADROOM = 3.0  # the engine directly vs the fastest router

# How the client asks and the engine answers: "no" stream; "yes" a stream the engine writes at
# once (the cells that load the routers most); "paced" a stream written one SSE event per write
# with PACE_MS before each token, as a real engine's tokens arrive (chunks reach the router
# one by one; the engine, not the router, sets the request rate, so CPU per request and added
# latency are what compare the routers there); "per-token" the same without pauses (not a
# default: the engine and the load generator, sharing their CPUs, then do more work per
# request than a router, so the cell measures them).
MODES = ("no", "yes", "paced", "per-token")
DEFAULT_MODES = ("no", "yes", "paced")
PACE_MS = 5
ENGINE_WRITES = {
    "no": "request",
    "yes": "request",
    "paced": f"token {PACE_MS}ms",
    "per-token": "token",
}


# --------------------------------------------------------------------------- /proc
def _descendants(pid: int) -> list[int]:
    """pid and every process below it (children of any of its threads)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            with contextlib.suppress(OSError, ValueError):
                todo += [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
    return out


def cpu_seconds(pid: int) -> float:
    """utime+stime of a process and all its descendants (their threads included)."""
    total = 0.0
    for p in _descendants(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK
    return total


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants (sum of their RSS), MB."""
    kb = 0
    for p in _descendants(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            kb += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE_KB
    return kb / 1024


# --------------------------------------------------------------------------- targets
@dataclass
class Target:
    key: str  # stable id in the JSON lines
    label: str
    impl: str  # engine | ours | vllm-router
    route: str  # engine | direct | nixl | lmcache
    url: str
    pid: int | None = None
    workers: int = 0
    logging: str = ""
    modes: tuple[str, ...] = MODES  # the modes it is measured in


@dataclass
class Bench:
    args: argparse.Namespace
    router_cpus: list[int] | None
    other_cpus: list[int] | None
    notes: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    engine_url: str = ""
    engine_writes: str = "request"  # fastengine's -flush default
    collectors: list[Any] = field(default_factory=list)  # otelcol.Collector of the traced rows


def _cpu_sets(n_router: int | None) -> tuple[list[int] | None, list[int] | None, str]:
    avail = sorted(os.sched_getaffinity(0))
    if n_router is None:
        n_router = max(1, len(avail) // 2)
    if len(avail) < 2 or n_router < 1 or n_router >= len(avail):
        return (
            None,
            None,
            (
                f"not pinned: {len(avail)} CPU(s) available, --router-cpus {n_router} leaves none "
                "for the engine and the load generator"
            ),
        )
    r, o = avail[:n_router], avail[n_router:]
    return r, o, f"routers pinned to CPU {_cpus(r)}, engine and load generator to CPU {_cpus(o)}"


def _cpus(cs: list[int]) -> str:
    return ",".join(map(str, cs))


def goodput_overrides(pre: str, dec: str) -> list[tuple[str, str, dict[str, Any]]]:
    """The goodput decision's rows: (key, label, the router config's overrides) on the fixed
    pools (one prefiller, one decoder) and on the flexible pool of the same two engines."""
    fixed = static_pools([pre], [dec])
    flexible = {
        "layout": "flexible",
        "prefill": None,  # the flexible layout's one pool is pools.decode
        "decode": {"discovery": "static", "static": [pre, dec]},
    }
    return [
        (key, label, {"routing": {"connector": "nixl", "decision": "goodput"}, "pools": pools})
        for key, label, pools in (
            ("ours-direct-goodput", "ours: direct route, goodput decision", fixed),
            ("ours-flex-goodput", "ours: flexible pool, goodput decision", flexible),
        )
    ]


def _router_config(
    workdir: Path, name: str, over: dict[str, Any], workers: int | None, level: str
) -> Path:
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    for k, v in over.items():  # a key set to None in ``over`` is removed
        cfg[k] = {kk: vv for kk, vv in {**cfg.get(k, {}), **v}.items() if vv is not None}
    if workers is not None:
        cfg["listen"] = {**cfg["listen"], "workers": workers}
    cfg["logging"] = {"level": level, "logPrompts": False}
    cfg["health"] = {**cfg["health"], "intervalSeconds": 5}
    cfg["limits"] = {**cfg["limits"], "maxInFlight": 1024, "maxQueued": 1024}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start_ours(
    b: Bench, st: Stack, name: str, over: dict[str, Any], level: str
) -> tuple[Proc, int]:
    """Our router with listen.workers = the router CPU count; a router that does not know the
    key yet is started with one worker (noted)."""
    want = len(b.router_cpus) if b.router_cpus else 1
    cfg = _router_config(st.workdir, name, over, want, level)
    try:
        return st.router(name, cfg, cpus=b.router_cpus), want
    except RuntimeError as exc:
        if "workers" not in str(exc):
            raise
    note = "this router refuses listen.workers: ours ran ONE worker process"
    if note not in b.notes:
        b.notes.append(note)
    return st.router(
        name, _router_config(st.workdir, name, over, None, level), cpus=b.router_cpus
    ), 1


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"{url} never answered 200")
        time.sleep(0.05)


def _add_peer(
    b: Any, st: Any, out: list[Any], key: str, label: str, route: str, command: Any
) -> None:
    """Start vllm-router (``command(port, *extra)``) with the limits every bench run gives it
    and add it to ``out`` as a target, unless it did not come up."""
    port = free_port()
    limits = ("--max-concurrent-requests", "1024", "--queue-size", "1024")
    cmd = command(port, *limits)
    pid = _start_vllm_router(b, st, key.replace("vr-", "vllm-router-"), cmd, port)
    if pid:
        out.append(Target(key, label, "vllm-router", route, f"http://127.0.0.1:{port}", pid))


def _start_vllm_router(b: Bench, st: Stack, name: str, cmd: list[str], port: int) -> int | None:
    with open(st.workdir / f"{name}.log", "wb") as log:  # the child keeps its own copy
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pinned(b.router_cpus),  # noqa: PLW1509 - sched_setaffinity only
        )
    b.procs.append(p)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", p)
    except RuntimeError as exc:
        tail = (st.workdir / f"{name}.log").read_text(errors="replace")[-800:]
        b.notes.append(f"{name} did not start: {exc}: {tail}")
        return None
    return p.pid


def _targets(b: Bench, st: Stack) -> list[Target]:
    wd = st.workdir
    eng, ports, sidecar = fastengine.start_engine(wd, "fastengine", 2, True, b.other_cpus)
    st.adopt(eng)
    pre, dec = (f"http://127.0.0.1:{p}" for p in ports)
    b.engine_url = dec
    nx_pools = static_pools([pre], [dec])
    direct_over = {"routing": {"connector": "nixl", "threshold": 1 << 30}, "pools": nx_pools}
    out = [Target("engine", "engine directly (fastengine)", "engine", "engine", dec)]

    r, w = _start_ours(b, st, "ours-direct", direct_over, "warning")
    out.append(
        Target("ours-direct", "ours: direct route", "ours", "direct", r.url(), r.pid, w, "warning")
    )
    vr_missing = not vllm_router_binary().exists()
    if vr_missing:
        b.notes.append("vllm-router is not installed (pip install 'pd-router[test]'): no peer rows")
    else:
        _add_peer(
            b,
            st,
            out,
            "vr-regular",
            "vllm-router: regular mode",
            "direct",
            lambda port, *extra: vllm_router_regular_command([dec], port, *extra),
        )
    r, w = _start_ours(b, st, "ours-direct-info", direct_over, "info")
    out.append(
        Target(
            "ours-direct-info",
            "ours: direct route, logging.level info",
            "ours",
            "direct",
            r.url(),
            r.pid,
            w,
            "info",
            modes=("no",),
        )
    )
    r, w = _start_ours(
        b,
        st,
        "ours-nixl",
        {"routing": {"connector": "nixl", "threshold": 0}, "pools": nx_pools},
        "warning",
    )
    out.append(
        Target("ours-nixl", "ours: NIXL route", "ours", "nixl", r.url(), r.pid, w, "warning")
    )
    if not vr_missing:
        _add_peer(
            b,
            st,
            out,
            "vr-pd",
            "vllm-router: PD mode (NIXL)",
            "nixl",
            lambda port, *extra: vllm_router_command(pre, dec, port, *extra),
        )
    lm_over = {
        "routing": {"connector": "lmcache", "threshold": 0},
        "pools": nx_pools,
        "lmcache": {
            "notificationReceiver": "prefillSidecar",
            "sidecarPort": sidecar,
            "notifyBindHost": "127.0.0.1",
            "notifyPort": free_port(),
        },
    }
    r, w = _start_ours(b, st, "ours-lmcache", lm_over, "warning")
    out.append(
        Target(
            "ours-lmcache",
            "ours: LMCache route (sidecar)",
            "ours",
            "lmcache",
            r.url(),
            r.pid,
            w,
            "warning",
        )
    )
    if not b.args.no_goodput:
        for key, label, over in goodput_overrides(pre, dec):
            r, w = _start_ours(b, st, key, over, "warning")
            out.append(Target(key, label, "ours", "direct", r.url(), r.pid, w, "warning"))
    if not b.args.no_tracing:
        _traced_targets(b, st, out, direct_over, nx_pools)
    for t in out:  # every target answers before anything is measured
        _probe(t)
    return out


def _traced_targets(
    b: Bench, st: Stack, out: list[Target], direct_over: dict[str, Any], nx_pools: dict[str, Any]
) -> None:
    """Our routes with tracing on, exporting to a real collector on the engine's CPUs."""
    try:
        col = otelcol.Collector(st.workdir, "bench-otelcol", keep=False, cpus=b.other_cpus)
    except RuntimeError as exc:
        b.notes.append(f"no tracing rows: {exc}")
        return
    b.collectors.append(col)
    nixl_over = {"routing": {"connector": "nixl", "threshold": 0}, "pools": nx_pools}
    for key, label, route, over, ratio, modes in (
        (
            "ours-direct-traced",
            "ours: direct route, traced",
            "direct",
            direct_over,
            1.0,
            ("no", "yes"),
        ),
        ("ours-nixl-traced", "ours: NIXL route, traced", "nixl", nixl_over, 1.0, ("no", "yes")),
        (
            "ours-nixl-unsampled",
            "ours: NIXL route, tracing on, ratio 0",
            "nixl",
            nixl_over,
            0.0,
            ("no",),
        ),
    ):
        tracing = {"tracing": {"endpoint": col.grpc, "samplingRatio": ratio}}
        r, w = _start_ours(b, st, key, {**over, **tracing}, "warning")
        out.append(Target(key, label, "ours", route, r.url(), r.pid, w, "warning", modes=modes))


def _profiled(b: Bench) -> Callable[[Stack, str, dict[str, Any]], profile.Started]:
    """How pd_router_dev.profile starts each router it profiles: as the bench starts ours,
    answering before it is measured."""

    def start(st: Stack, name: str, over: dict[str, Any]) -> profile.Started:
        router, _ = _start_ours(b, st, name, over, "warning")
        t = Target(name, name, "ours", name, router.url(), router.pid)
        _probe(t)
        return router.url(), router.pid, router.stop

    return start


def _probe(t: Target) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    req = urllib.request.Request(
        t.url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    end = time.monotonic() + 30
    while True:  # a router answers 503 until its first health round saw the engines
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{t.label} at {t.url} does not answer a chat completion")
        time.sleep(0.05)


def _body(stream: bool) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


def _engine_writes(b: Bench, mode: str) -> None:
    """Tell the engine how to write streams (one write per stream or per token)."""
    want = ENGINE_WRITES[mode]
    if b.engine_writes == want:
        return
    req = urllib.request.Request(b.engine_url + "/fastengine/flush", want.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()
    b.engine_writes = want


def measure(b: Bench, t: Target, conc: int, mode: str) -> dict[str, Any]:
    a = b.args
    stream = mode != "no"
    _engine_writes(b, mode)
    cpu0 = cpu_seconds(t.pid) if t.pid else 0.0
    w0 = time.monotonic()
    p = fastengine.run_load(
        t.url + "/v1/chat/completions",
        _body(stream),
        conc,
        a.duration,
        a.warmup,
        stream,
        b.other_cpus,
    )
    rss = 0.0
    limit = time.monotonic() + a.warmup + a.duration + 60
    while True:  # sample the router's memory while the load runs
        try:
            p.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if t.pid:
                rss = max(rss, rss_mb(t.pid))
            if time.monotonic() > limit:
                p.kill()
    res = fastengine.load_result(p, 10)
    wall = time.monotonic() - w0
    row: dict[str, Any] = {
        "kind": "cell",
        "target": t.key,
        "label": t.label,
        "impl": t.impl,
        "route": t.route,
        "conc": conc,
        "mode": mode,
        "stream": stream,
        "engine_writes": b.engine_writes,
        "rps": res["rps"],
        "p50_ms": res["p50_ms"],
        "p99_ms": res["p99_ms"],
        "ttft_p50_ms": res["ttft_p50_ms"],
        "requests": res["requests"],
        "errors": res["errors"],
        "errors_all": res["errors_all"],
        "requests_all": res["requests_all"],
        "first_error": res.get("first_error", ""),
        "duration_s": a.duration,
        "max_tokens": MAX_TOKENS,
        "router_cpus": b.router_cpus,
        "workers": t.workers or None,
        "logging": t.logging or None,
    }
    if t.pid:
        cpu = cpu_seconds(t.pid) - cpu0
        n = max(1, res["requests_all"])
        row.update(cpu_us_per_req=cpu * 1e6 / n, cores_busy=cpu / wall, rss_mb=rss)
    return row


# --------------------------------------------------------------------------- tables
def _f(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _ok(v: float | None, target: float, at_most: bool) -> str:
    if v is None:
        return "-"
    good = v <= target if at_most else v >= target
    return f"{v:.2f} {'✓' if good else '✗'}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _row(*cols: Any) -> str:
    return "| " + " | ".join(str(c) for c in cols) + " |"


def _cell_table(cells: list[dict[str, Any]], concs: list[int], by: dict[Any, Any]) -> list[str]:
    lines = [
        _row(
            "clients",
            "stream",
            "target",
            "req/s",
            "p50 ms",
            "p99 ms",
            "added p50 ms",
            "TTFT p50 ms",
            "CPU µs/req",
            "cores busy",
            "RSS MB",
            "errors",
        ),
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = list(dict.fromkeys(c["target"] for c in cells))  # as started
    for conc in concs:
        for mode in MODES:
            base = by.get(("engine", conc, mode))
            for key in order:
                c = by.get((key, conc, mode))
                if c is None:
                    continue
                added = None
                if base and key != "engine" and None not in (c["p50_ms"], base["p50_ms"]):
                    added = c["added_p50_ms"] = c["p50_ms"] - base["p50_ms"]
                lines.append(
                    _row(
                        conc,
                        mode,
                        c["label"],
                        f"{c['rps']:.0f}",
                        _f(c["p50_ms"]),
                        _f(c["p99_ms"]),
                        _f(added, "{:+.3f}"),
                        _f(c["ttft_p50_ms"]) if mode != "no" else "-",
                        _f(c.get("cpu_us_per_req"), "{:.0f}"),
                        _f(c.get("cores_busy")),
                        _f(c.get("rss_mb"), "{:.0f}"),
                        c["errors"],
                    )
                )
    return lines


def _headroom(
    cells: list[dict[str, Any]], concs: list[int], by: dict[Any, Any], extra: list[Any]
) -> list[str]:
    lines = [
        "",
        f"**The engine directly vs the fastest router** (at least {ENGINE_HEADROOM:g} times, "
        "or the engine is what is measured; not the paced cells, whose rate the engine's "
        "pauses set):",
        "",
        _row("clients", "stream", "engine req/s", "fastest router", "its req/s", "engine / it"),
        "|---:|---|---:|---|---:|---:|",
    ]
    for conc in concs:
        for mode in MODES:
            if mode == "paced":
                continue
            base = by.get(("engine", conc, mode))
            routers = [
                c
                for c in by.values()
                if c["conc"] == conc and c["mode"] == mode and c["impl"] != "engine"
            ]
            if not base or not routers:
                continue
            top = max(routers, key=lambda c: c["rps"])
            r = _ratio(base["rps"], top["rps"])
            extra.append(
                {
                    "kind": "headroom",
                    "conc": conc,
                    "mode": mode,
                    "engine_rps": base["rps"],
                    "fastest": top["target"],
                    "fastest_rps": top["rps"],
                    "ratio": r,
                }
            )
            lines.append(
                _row(
                    conc,
                    mode,
                    f"{base['rps']:.0f}",
                    top["label"],
                    f"{top['rps']:.0f}",
                    _ok(r, ENGINE_HEADROOM, False),
                )
            )
    return lines


PAIRS = (
    ("direct", "ours-direct", "vr-regular", "direct route / regular mode"),
    ("nixl", "ours-nixl", "vr-pd", "NIXL route / PD mode"),
)


def _peer_ratios(concs: list[int], by: dict[Any, Any], extra: list[Any]) -> list[str]:
    lines = [
        "",
        f"**Ours / vllm-router** (targets: CPU per request at most {CPU_TARGET}, req/s at least "
        f"{RPS_TARGET}, added p50 at c=1 at most {ADDED_P50_TARGET}; RSS for information; "
        "paced rows: their req/s is set by the engine, CPU per request is what counts):",
        "",
        _row("pair", "stream", "clients", "CPU/req", "req/s", "added p50", "RSS"),
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for route, ours, theirs, label in PAIRS:
        for mode in MODES:
            for conc in concs:
                o, t = by.get((ours, conc, mode)), by.get((theirs, conc, mode))
                if not o or not t:
                    continue
                cpu = _ratio(o.get("cpu_us_per_req"), t.get("cpu_us_per_req"))
                rps = _ratio(o["rps"], t["rps"])
                add = _ratio(o.get("added_p50_ms"), t.get("added_p50_ms"))
                mem = _ratio(o.get("rss_mb"), t.get("rss_mb"))
                extra.append(
                    {
                        "kind": "ratio",
                        "pair": route,
                        "ours": ours,
                        "theirs": theirs,
                        "conc": conc,
                        "mode": mode,
                        "cpu_per_req": cpu,
                        "rps": rps,
                        "added_p50": add,
                        "rss": mem,
                        "cpu_ok": cpu is not None and cpu <= CPU_TARGET,
                        "rps_ok": rps is not None and rps >= RPS_TARGET,
                        "added_p50_ok": None
                        if conc != 1
                        else (add is not None and add <= ADDED_P50_TARGET),
                    }
                )
                lines.append(
                    _row(
                        label,
                        mode,
                        conc,
                        _ok(cpu, CPU_TARGET, True),
                        _ok(rps, RPS_TARGET, False),
                        _ok(add, ADDED_P50_TARGET, True) if conc == 1 else _f(add),
                        _f(mem),
                    )
                )
    return lines


def _lmcache_vs_nixl(concs: list[int], by: dict[Any, Any], extra: list[Any]) -> list[str]:
    lines = [
        "",
        f"**Our LMCache route / our NIXL route** (targets: req/s at least {LMCACHE_RPS_TARGET}, "
        f"CPU per request at most {LMCACHE_CPU_TARGET}):",
        "",
        _row("stream", "clients", "req/s", "CPU/req", "added p50"),
        "|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for conc in concs:
            lm = by.get(("ours-lmcache", conc, mode))
            nx = by.get(("ours-nixl", conc, mode))
            if not lm or not nx:
                continue
            rps = _ratio(lm["rps"], nx["rps"])
            cpu = _ratio(lm.get("cpu_us_per_req"), nx.get("cpu_us_per_req"))
            add = _ratio(lm.get("added_p50_ms"), nx.get("added_p50_ms"))
            extra.append(
                {
                    "kind": "lmcache_vs_nixl",
                    "conc": conc,
                    "mode": mode,
                    "rps": rps,
                    "cpu_per_req": cpu,
                    "added_p50": add,
                }
            )
            lines.append(
                _row(
                    mode,
                    conc,
                    _ok(rps, LMCACHE_RPS_TARGET, False),
                    _ok(cpu, LMCACHE_CPU_TARGET, True),
                    _f(add),
                )
            )
    return lines


def _log_line(concs: list[int], by: dict[Any, Any], extra: list[Any]) -> list[str]:
    lines = [
        "",
        "**What the per-request log line costs** (our direct route, non-streaming: "
        "`logging.level: info`, the default, writes one JSON access line per request; "
        "`warning`, as in every other row, none):",
        "",
        _row("clients", "req/s info / warning", "CPU µs/req info", "warning", "the line costs"),
        "|---:|---:|---:|---:|---:|",
    ]
    for conc in concs:
        i, w = by.get(("ours-direct-info", conc, "no")), by.get(("ours-direct", conc, "no"))
        if not i or not w:
            continue
        ci, cw = i.get("cpu_us_per_req"), w.get("cpu_us_per_req")
        cost = None if ci is None or cw is None else ci - cw
        rr = _ratio(i["rps"], w["rps"])
        extra.append(
            {
                "kind": "log_line",
                "conc": conc,
                "rps_ratio": rr,
                "cpu_us_info": ci,
                "cpu_us_warning": cw,
                "cost_us": cost,
            }
        )
        lines.append(_row(conc, _f(rr), _f(ci, "{:.0f}"), _f(cw, "{:.0f}"), _f(cost, "{:+.0f} µs")))
    return lines


def _goodput_cost(concs: list[int], by: dict[Any, Any], extra: list[Any]) -> list[str]:
    """The goodput decision against today's (prefix), a short prompt's direct route, same run:
    what weighing the options costs the router per request (issue 33: at most 1.2 x)."""
    rows = []
    for key, what in (
        ("ours-direct-goodput", "fixed pools (1 decoder)"),
        ("ours-flex-goodput", "flexible pool (2 engines)"),
    ):
        for conc in concs:
            for mode in ("no", "yes"):
                new, old = by.get((key, conc, mode)), by.get(("ours-direct", conc, mode))
                if not new or not old:
                    continue
                cn, co = new.get("cpu_us_per_req"), old.get("cpu_us_per_req")
                cpu_ratio, rps_ratio = _ratio(cn, co), _ratio(new["rps"], old["rps"])
                extra.append(
                    {
                        "kind": "goodput_cost",
                        "target": key,
                        "conc": conc,
                        "mode": mode,
                        "cpu_us_goodput": cn,
                        "cpu_us_prefix": co,
                        "cpu_ratio": cpu_ratio,
                        "rps_ratio": rps_ratio,
                    }
                )
                rows.append(
                    _row(
                        what,
                        conc,
                        mode,
                        _f(cn, "{:.0f}"),
                        _f(co, "{:.0f}"),
                        _f(cpu_ratio),
                        _f(rps_ratio),
                    )
                )
    if not rows:
        return []
    return [
        "",
        "**What the goodput decision costs the router** (a short chat prompt, served whole, "
        "against today's decision, `prefix`, on the same engine; target CPU ratio at most 1.2):",
        "",
        _row(
            "pools",
            "clients",
            "stream",
            "CPU µs/req goodput",
            "prefix",
            "CPU goodput / prefix",
            "req/s goodput / prefix",
        ),
        "|---|---:|---|---:|---:|---:|---:|",
        *rows,
    ]


def _tracing_cost(concs: list[int], by: dict[Any, Any], extra: list[Any]) -> list[str]:
    """Tracing on against off (the default), same route, same run: what it costs the router."""
    pairs = (
        ("direct", "ours-direct-traced", "ours-direct", "1"),
        ("NIXL", "ours-nixl-traced", "ours-nixl", "1"),
        ("NIXL", "ours-nixl-unsampled", "ours-nixl", "0"),
    )
    rows = []
    for route, on_key, off_key, ratio in pairs:
        for conc in concs:
            for mode in ("no", "yes"):
                on, off = by.get((on_key, conc, mode)), by.get((off_key, conc, mode))
                if not on or not off:
                    continue
                con, coff = on.get("cpu_us_per_req"), off.get("cpu_us_per_req")
                cost = None if con is None or coff is None else con - coff
                cpu_ratio, rps_ratio = _ratio(con, coff), _ratio(on["rps"], off["rps"])
                extra.append(
                    {
                        "kind": "tracing_cost",
                        "route": route.lower(),
                        "sampling_ratio": float(ratio),
                        "conc": conc,
                        "mode": mode,
                        "cpu_us_on": con,
                        "cpu_us_off": coff,
                        "cost_us": cost,
                        "cpu_ratio": cpu_ratio,
                        "rps_ratio": rps_ratio,
                    }
                )
                rows.append(
                    _row(
                        route,
                        ratio,
                        conc,
                        mode,
                        _f(con, "{:.0f}"),
                        _f(coff, "{:.0f}"),
                        _f(cost, "{:+.0f} µs"),
                        _f(cpu_ratio),
                        _f(rps_ratio),
                    )
                )
    if not rows:
        return []
    return [
        "",
        "**What tracing costs the router** (tracing on, every span exported over OTLP/gRPC to "
        "the OpenTelemetry Collector, against the same route with tracing off, the default; "
        "sampling ratio 0: on, but no request sampled):",
        "",
        _row(
            "route",
            "ratio",
            "clients",
            "stream",
            "CPU µs/req on",
            "off",
            "tracing costs",
            "CPU on / off",
            "req/s on / off",
        ),
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _mixed_table(rows: list[dict[str, Any]]) -> list[str]:
    spec = mixed.Spec(**rows[0]["spec"])
    head = (
        "setup",
        "short TTFT p50 / p99 ms",
        "short ITL p50 / p99 / p99.9 / max ms",
        f"short requests stalled (an ITL > {rows[0]['stall_ms']:g} ms)",
        "long TTFT p50 / max ms",
        "long ITL p50 ms",
        "requests (errors)",
        "routes",
    )
    lines = [
        "",
        f"**Mixed traffic** ({spec.describe()}; our router pinned as above):",
        "",
        _row(*head),
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in rows:
        routes = ", ".join(f"{k}: {v}" for k, v in sorted(m["routes"].items()))
        itl = " / ".join(
            [_f(m["short_itl_p50_ms"], "{:.1f}"), _f(m["short_itl_p99_ms"], "{:.1f}")]
            + [_f(m[k], "{:.0f}") for k in ("short_itl_p999_ms", "short_itl_max_ms")]
        )
        lines.append(
            _row(
                m["setup"],
                f"{_f(m['short_ttft_p50_ms'], '{:.0f}')} / {_f(m['short_ttft_p99_ms'], '{:.0f}')}",
                itl,
                _f(m["short_stalled_share"], "{:.0%}"),
                f"{_f(m['long_ttft_p50_ms'], '{:.0f}')} / {_f(m['long_ttft_max_ms'], '{:.0f}')}",
                _f(m["long_itl_p50_ms"], "{:.1f}"),
                f"{m['requests']} ({m['errors']})",
                routes,
            )
        )
    return lines


def _classes(by_class: dict[str, dict[str, int]]) -> str:
    order = ("turn 1", "later turn", "long", "short")
    keys = [k for k in order if k in by_class] + sorted(set(by_class) - set(order))
    return "; ".join(f"{k}: " + ", ".join(f"{r} {n}" for r, n in by_class[k].items()) for k in keys)


def _multiturn_table(rows: list[dict[str, Any]], extra: list[Any]) -> list[str]:
    spec = rows[0]["spec"]
    desc = multiturn.Spec(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    ).describe()
    head = (
        "setup",
        "TTFT p50 / p99 ms",
        "later turns: TTFT p50 / p99 ms (n)",
        "ITL p50 / p99 ms",
        "prefiller busy s",
        "engines busy s",
        "prompt tokens computed",
        "KV tokens moved (transfers)",
        "requests (errors)",
        "x-pd-reason seen",
    )
    lines = [
        "",
        f"**Multi-turn chat** ({desc}; our router pinned as above; busy = seconds of engine "
        "steps, `pd_sim_busy_seconds_total`; KV moved = what the decoder pulled over NIXL):",
        "",
        _row(*head),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in rows:
        lines.append(
            _row(
                m["label"],
                f"{_f(m['ttft_p50_ms'], '{:.0f}')} / {_f(m['ttft_p99_ms'], '{:.0f}')}",
                f"{_f(m['later_ttft_p50_ms'], '{:.0f}')} / "
                f"{_f(m['later_ttft_p99_ms'], '{:.0f}')} ({m['later_n']})",
                f"{_f(m['itl_p50_ms'], '{:.1f}')} / {_f(m['itl_p99_ms'], '{:.1f}')}",
                _f(m["prefill_busy_s"], "{:.1f}"),
                _f(m["engines_busy_s"], "{:.1f}"),
                f"{m['computed_tokens']:,.0f}",
                f"{m['kv_tokens_moved']:,.0f} ({m['kv_transfers']:.0f})",
                f"{m['requests']} ({m['errors']})",
                _classes(m["reasons_by_class"]),
            )
        )
    cmp = multiturn.compare(rows)
    if cmp is None:
        return lines
    extra.append(cmp)
    kv = cmp["kv_tokens"]
    kv_cell = "-" if kv is None else f"{kv:.2f} {'✓' if cmp['kv_tokens_ok'] else '✗'}"
    lines += [
        "",
        "**decision: prefix / decision: length** (issue 13's targets: later-turn TTFT p50 at "
        f"most {multiturn.LATER_TTFT_TARGET:g} (2x lower), ITL p99 at most "
        f"{multiturn.ITL_P99_TARGET:g}, KV tokens moved below 1):",
        "",
        _row(
            "later-turn TTFT p50",
            "ITL p99",
            "KV tokens moved",
            "prefiller busy",
            "TTFT p50 (all)",
            "TTFT p99 (all)",
        ),
        "|---:|---:|---:|---:|---:|---:|",
        _row(
            _ok(cmp["later_ttft_p50"], multiturn.LATER_TTFT_TARGET, True),
            _ok(cmp["itl_p99"], multiturn.ITL_P99_TARGET, True),
            kv_cell,
            _f(cmp["prefill_busy"]),
            _f(cmp["ttft_p50"]),
            _f(cmp["ttft_p99"]),
        ),
    ]
    return lines


def _decision_cost_table(rows: list[dict[str, Any]]) -> list[str]:
    r0 = rows[0]
    lines = [
        "",
        "**The decision's cost** (`pd_router.decide.Decider` in this process with a byte-level "
        f"BPE tokenizer of {decision_cost.VOCAB:,} tokens trained here; chat prompts of "
        f"{r0['prompt_tokens']:,.0f} tokens, {r0['bytes_per_token']:.2f} bytes/token; the mean "
        f"of {r0['runs']} decisions per case; `prefix` includes `Decider.remember`; issue 15's "
        f"targets: the loop blocked at most {decision_cost.LOOP_TARGET_MS:g} ms, at most "
        f"{decision_cost.TOTAL_TARGET_MS:g} ms of CPU where bounds decide; near the threshold "
        "the exact count runs in a thread, its CPU for information):",
        "",
        _row(
            "case",
            "threshold",
            "counted by",
            "loop blocked ms (p99)",
            "loop thread CPU ms",
            "process CPU ms",
            "wall ms",
        ),
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        total = r["total_cpu_ms"]
        tot = _f(total, "{:.2f}") if r["total_ok"] is None else _ok(total, 2.0, True)
        lines.append(
            _row(
                r["label"],
                r["threshold"],
                ", ".join(r["sources"]),
                f"{_ok(r['loop_blocked_ms'], decision_cost.LOOP_TARGET_MS, True)} "
                f"({r['loop_blocked_p99_ms']:.2f})",
                _f(r["loop_cpu_ms"]),
                tot,
                _f(r["wall_ms"]),
            )
        )
    return lines


def render(
    b: Bench,
    cells: list[dict[str, Any]],
    mixed_rows: list[dict[str, Any]],
    header: str,
    multiturn_rows: list[dict[str, Any]] | None = None,
    cost_rows: list[dict[str, Any]] | None = None,
    profile_rows: list[dict[str, Any]] | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """The markdown report and the derived rows (ratios etc., also written as JSON lines)."""
    lines = [header, ""]
    by = {(c["target"], c["conc"], c["mode"]): c for c in cells if c.get("best")}
    concs = sorted({c["conc"] for c in cells})
    extra: list[dict[str, Any]] = []
    if cells:
        lines += _cell_table(cells, concs, by)
        lines += _headroom(cells, concs, by, extra)
        lines += _peer_ratios(concs, by, extra)
        lines += _lmcache_vs_nixl(concs, by, extra)
        lines += _log_line(concs, by, extra)
        lines += _goodput_cost(concs, by, extra)
        lines += _tracing_cost(concs, by, extra)
    if mixed_rows:
        lines += _mixed_table(mixed_rows)
    if multiturn_rows:
        lines += _multiturn_table(multiturn_rows, extra)
    kv_rows = [r for r in cost_rows or () if r["kind"].startswith("kv_events")]
    gp_rows = [r for r in cost_rows or () if r["kind"] == "goodput_decision_cost"]
    cost_rows = [r for r in cost_rows or () if r["kind"] == "decision_cost"]
    if cost_rows:
        lines += _decision_cost_table(cost_rows)
    if gp_rows:
        lines += goodput_cost.table(gp_rows)
    if kv_rows:
        lines += kv_events_cost.table(kv_rows)
    if profile_rows:
        lines += profile.table(profile_rows)
    if b.notes:
        lines += ["", *(f"Note: {n}" for n in b.notes)]
    return "\n".join(lines), extra


# --------------------------------------------------------------------------- main
def _progress(row: dict[str, Any]) -> str:
    return (
        f"  c={row['conc']:<3d} stream={row['mode']:9s} {row['label']:38s} "
        f"{row['rps']:8.0f} req/s  p50 {_f(row['p50_ms'], '{:7.3f}')} ms  "
        f"CPU {_f(row.get('cpu_us_per_req'), '{:5.0f}')} µs/req  errors {row['errors']}"
    )


def _matrix(
    b: Bench, concs: list[int], modes: list[str], pin_note: str, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every cell, ``--rounds`` times, the targets in turn (reversed every other round); the
    round with the most requests/s is each cell's figure (``best``: interference from
    anything else on the machine only ever lowers it)."""
    a = b.args
    cells: list[dict[str, Any]] = []
    with Stack() as st:
        try:
            targets = _targets(b, st)
            say(f"bench: {len(targets)} targets; {pin_note}")
            for conc in concs:
                for mode in modes:
                    if mode == "paced" and conc not in a.paced_concurrency:
                        continue
                    group = [t for t in targets if mode in t.modes]
                    rounds: dict[str, list[dict[str, Any]]] = {t.key: [] for t in group}
                    for r in range(a.rounds):
                        for t in group if r % 2 == 0 else reversed(group):
                            row = measure(b, t, conc, mode)
                            row["round"] = r
                            rounds[t.key].append(row)
                            cells.append(row)
                    for t in group:
                        best = max(rounds[t.key], key=lambda row: row["rps"])
                        best["best"] = True
                        say(_progress(best))
        finally:
            for col in b.collectors:
                col.stop()
            for pr in b.procs:
                pr.terminate()
                try:
                    pr.wait(5)
                except subprocess.TimeoutExpired:
                    pr.kill()
                    pr.wait(5)
    return cells


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="pd_router_dev.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--duration", type=float, default=1.2, help="measured seconds per cell and round"
    )
    p.add_argument(
        "--warmup", type=float, default=0.3, help="seconds of load before each measured window"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measure every cell this many times, the targets in alternating order; the "
        "best round counts (default 2)",
    )
    p.add_argument(
        "--paced-concurrency",
        default="32",
        help=f"client counts of the paced-stream cells ({PACE_MS} ms between tokens)",
    )
    p.add_argument("--concurrency", default="1,32,256", help="client counts (default 1,32,256)")
    p.add_argument(
        "--router-cpus",
        type=int,
        default=None,
        help="CPUs each router is pinned to (default: half of those available, at least 1); "
        "the engine and the load generator get the rest; our router runs that many workers",
    )
    p.add_argument(
        "--mixed-duration",
        type=float,
        default=mixed.Spec.duration,
        help="seconds of mixed-traffic arrivals per setup",
    )
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="no: not streamed; yes: streamed, the engine writing each stream at once; paced: "
        f"one engine write per SSE event, {PACE_MS} ms apart; per-token: the same without "
        f"pauses (default: {','.join(DEFAULT_MODES)})",
    )
    p.add_argument(
        "--multiturn-duration",
        type=float,
        default=multiturn.Spec.duration,
        help="seconds of multi-turn chat arrivals per setup",
    )
    p.add_argument(
        "--decision-cost-runs",
        type=int,
        default=100,
        help="decisions measured per case of the decision's cost (default 100)",
    )
    p.add_argument("--no-matrix", action="store_true", help="skip the throughput matrix")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed-traffic scenario")
    p.add_argument("--no-multiturn", action="store_true", help="skip the multi-turn chat scenario")
    p.add_argument(
        "--no-decision-cost", action="store_true", help="skip the decision's cost measurement"
    )
    p.add_argument(
        "--no-kv-events-cost",
        action="store_true",
        help="skip the KV-cache events' cost measurement (decision on/off, ingest)",
    )
    p.add_argument(
        "--profile-seconds",
        type=float,
        default=8.0,
        help="seconds py-spy samples each of our routes (default 8)",
    )
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    p.add_argument(
        "--no-goodput",
        action="store_true",
        help="skip the goodput decision's rows (its CPU per request against today's decision)",
    )
    p.add_argument(
        "--no-tracing",
        action="store_true",
        help="skip the traced rows (tracing on against off; a router without tracing refuses them)",
    )
    p.add_argument(
        "--out",
        default="bench-results/bench.md",
        help="write the markdown table here and the JSON lines beside it (.jsonl)",
    )
    a = p.parse_args(argv)
    concs = [int(c) for c in a.concurrency.split(",") if c.strip()]
    modes = [m for m in a.modes.split(",") if m.strip()]
    a.paced_concurrency = [int(c) for c in a.paced_concurrency.split(",") if c.strip()]
    if not set(modes) <= set(MODES):
        p.error(f"--modes: each one of {', '.join(MODES)}")
    router_cpus, other_cpus, pin_note = _cpu_sets(a.router_cpus)
    b = Bench(a, router_cpus, other_cpus)
    say: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    t_start = time.monotonic()
    cells: list[dict[str, Any]] = []
    mixed_rows: list[dict[str, Any]] = []
    mt_rows: list[dict[str, Any]] = []
    cost_rows: list[dict[str, Any]] = []
    profile_rows: list[dict[str, Any]] = []
    failed = False
    if not a.no_matrix:
        try:
            fastengine.binary()  # built (once) before anything starts
        except fastengine.BuildError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            b.notes.append(f"no throughput matrix: {exc}")
            failed = True
        else:
            cells = _matrix(b, concs, modes, pin_note, say)
    if not a.no_mixed:
        say("bench: mixed traffic on simulated engines")
        spec = mixed.Spec(duration=a.mixed_duration)
        mixed_rows = mixed.run(spec, router_cpus, other_cpus, say)
    if not a.no_multiturn:
        say("bench: multi-turn chat on simulated engines")
        mt_spec = multiturn.Spec(duration=a.multiturn_duration)
        mt_rows = multiturn.run(mt_spec, router_cpus, other_cpus, say)
    if not a.no_decision_cost:
        say("bench: the routing decision's cost, in this process")
        cost_rows = decision_cost.run(a.decision_cost_runs, say)
        cost_rows += goodput_cost.run(log=say)
    if not a.no_kv_events_cost:
        say("bench: the KV-cache events' cost, in this process")
        cost_rows += kv_events_cost.run(log=say)
    if not a.no_profile and not failed:  # fastengine built above, or now
        try:
            fastengine.binary()
        except fastengine.BuildError as exc:
            b.notes.append(f"no profile: {exc}")
        else:
            say("bench: where our router's CPU goes (py-spy)")
            keep = Path(a.out).parent if a.out else None
            profile_rows = profile.run(b, say, keep, _profiled(b), _body(False))
    header = (
        f"## make bench ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, {pin_note}; "
        f"our router with listen.workers = {len(router_cpus) if router_cpus else 1} unless noted; "
        f"each cell the best of {a.rounds} rounds of {a.duration:g} s (after {a.warmup:g} s of "
        "warm-up), the targets in alternating order; chat completions, "
        f"{MAX_TOKENS} output tokens; engine: fastengine (Go, zero delay); stream `yes`: the "
        f"engine writes each stream at once, `paced`: one write per token, {PACE_MS} ms apart; "
        "vllm-router 0.1.17 --policy round_robin)"
    )
    table, extra = render(b, cells, mixed_rows, header, mt_rows, cost_rows, profile_rows)
    print()
    print(table)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
        with open(out.with_suffix(".jsonl"), "w") as f:
            for row in [*cells, *extra, *mixed_rows, *mt_rows, *cost_rows, *profile_rows]:
                f.write(json.dumps(row) + "\n")
        took = time.monotonic() - t_start
        print(f"\nbench: wrote {out} and {out.with_suffix('.jsonl')} in {took:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
