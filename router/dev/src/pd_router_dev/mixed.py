"""``make bench``'s mixed-traffic scenario: short and long prompts at a steady rate through our
router onto simulated engines that take time (pd_router_dev.sim with vLLM V1's chunked-prefill
scheduler, sim/engine.py), with the same number of engines each way:

- colocated: 2 engines, each prefilling and decoding, chunked prefill with the per-step token
  budget ``max_num_batched_tokens`` (vLLM's default for an API server on H100/H200, 8192, and
  a smaller one, 2048, which favours inter-token latency); the router's direct route only;
- disaggregated: 1 prefill + 1 decode engine (NIXL), prompts of ``threshold`` tokens or more
  prefilled apart, the shorter ones served by the decoder directly.

Arrivals are fixed-interval (no bursts, which would only hurt the colocated engines more) and
every ``long_every``-th prompt is long. Prompts are token ids on ``/v1/completions`` so that
neither the router nor the simulator tokenizes: vLLM tokenizes in its API server process,
beside the engine core's step loop, which a one-process simulator cannot reproduce. Every
request streams; the client times each token's SSE event (TTFT: from sending the request to
the first token; ITL: between successive tokens of one request).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from pd_router_dev.devstack import DEMO_CONFIG, Stack, static_pools

MODEL = "llama-3.3-70b"


@dataclass(frozen=True)
class Spec:
    duration: float = 20.0  # seconds of arrivals
    warmup: float = 2.0  # arrivals in the first seconds are not counted
    rate: float = 4.0  # requests per second, fixed interval
    long_every: int = 5  # every 5th prompt is long: 20 %
    short_tokens: int = 250
    long_tokens: int = 8000
    max_tokens: int = 64
    threshold: int = 4096  # the disaggregated router's routing.threshold
    prefill_ms_per_token: float = 0.05  # 8,000 tokens: 400 ms of prefill
    decode_step_ms: float = 15.0
    decode_step_ms_per_seq: float = 0.05
    transfer_ms: float = 20.0  # NIXL: the decoder waits this long for a prompt's KV
    step_time: str = "max"  # sim/engine.py: the larger of compute- and memory-bound time

    def describe(self) -> str:
        return (
            f"simulated engines: prefill {self.prefill_ms_per_token:g} ms/token, decode step "
            f"{self.decode_step_ms:g} ms + {self.decode_step_ms_per_seq:g} ms/sequence, step "
            f"time = {'max(compute, memory)' if self.step_time == 'max' else 'prefill + decode'}"
            f", NIXL KV transfer {self.transfer_ms:g} ms; {self.rate:g} req/s at fixed "
            f"intervals for {self.duration:g} s (first {self.warmup:g} s not counted), every "
            f"{self.long_every}th prompt {self.long_tokens:,} tokens, the others "
            f"{self.short_tokens}, {self.max_tokens} output tokens, streamed"
        )


@dataclass(frozen=True)
class Setup:
    name: str
    disaggregated: bool
    budget: int


SETUPS = (
    Setup("colocated: 2 engines, chunked prefill, budget 8192", False, 8192),
    Setup("colocated: 2 engines, chunked prefill, budget 2048", False, 2048),
    Setup("disaggregated: 1 prefill + 1 decode (NIXL), budget 8192", True, 8192),
)


def _sim_args(spec: Spec, budget: int, *extra: str) -> list[str]:
    return [
        "--prefill-ms-per-token",
        str(spec.prefill_ms_per_token),
        "--decode-step-ms",
        str(spec.decode_step_ms),
        "--decode-step-ms-per-seq",
        str(spec.decode_step_ms_per_seq),
        "--transfer-ms",
        str(spec.transfer_ms),
        "--step-time",
        spec.step_time,
        "--max-num-batched-tokens",
        str(budget),
        *extra,
    ]


def _router_config(workdir: Path, name: str, over: dict[str, Any]) -> Path:
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    cfg["logging"] = {"level": "warning", "logPrompts": False}
    cfg["health"] = {**cfg["health"], "intervalSeconds": 5}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _prompt(i: int, n: int) -> list[int]:
    base = 1000 + (i * 7919) % 20000
    return [base + (j * 31) % 9000 for j in range(n)]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


async def _drive(url: str, spec: Spec) -> list[dict[str, Any]]:
    import aiohttp

    n = int(spec.duration * spec.rate)
    out: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=spec.duration + 120, sock_connect=5)

    async def one(session: aiohttp.ClientSession, i: int, at: float) -> None:
        long = i % spec.long_every == spec.long_every - 1
        body = orjson.dumps(
            {
                "model": MODEL,
                "prompt": _prompt(i, spec.long_tokens if long else spec.short_tokens),
                "max_tokens": spec.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        )
        rec: dict[str, Any] = {"i": i, "long": long, "at": at, "tokens": [], "ok": False}
        t0 = time.perf_counter()
        try:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                rec["route"] = r.headers.get("x-pd-route", "")
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        rec["ok"] = r.status == 200
                        break
                    ev = orjson.loads(payload)
                    ch = ev.get("choices") or []
                    if ch and ch[0].get("text"):
                        rec["tokens"].append(time.perf_counter() - t0)
        except (aiohttp.ClientError, TimeoutError) as exc:
            rec["error"] = repr(exc)
        out.append(rec)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for i in range(n):
            at = i / spec.rate
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule, not a synchronisation
            tasks.append(asyncio.create_task(one(session, i, at)))
        await asyncio.wait_for(asyncio.gather(*tasks), spec.duration + 180)
    return out


def _summary(recs: list[dict[str, Any]], spec: Spec) -> dict[str, Any]:
    counted = [r for r in recs if r["at"] >= spec.warmup]
    ok = [r for r in counted if r["ok"] and r["tokens"]]

    def ttft(rs: list[dict[str, Any]]) -> list[float]:
        return [r["tokens"][0] * 1000 for r in rs]

    def itl(rs: list[dict[str, Any]]) -> list[float]:
        return [
            (b - a) * 1000 for r in rs for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)
        ]

    short = [r for r in ok if not r["long"]]
    long = [r for r in ok if r["long"]]
    stall_ms = 3 * spec.decode_step_ms  # a token later than three decode steps: a visible stall
    stalled = [r for r in short if max(itl([r]), default=0.0) > stall_ms]
    routes: dict[str, int] = {}
    for r in counted:
        key = ("long " if r["long"] else "short ") + (r.get("route") or "?")
        routes[key] = routes.get(key, 0) + 1
    return {
        "requests": len(counted),
        "errors": len(counted) - len(ok),
        "short_n": len(short),
        "long_n": len(long),
        "short_ttft_p50_ms": _pct(ttft(short), 0.5),
        "short_ttft_p99_ms": _pct(ttft(short), 0.99),
        "short_itl_p50_ms": _pct(itl(short), 0.5),
        "short_itl_p99_ms": _pct(itl(short), 0.99),
        "short_itl_p999_ms": _pct(itl(short), 0.999),
        "short_itl_max_ms": max(itl(short), default=None),
        "short_itl_samples": len(itl(short)),
        "stall_ms": stall_ms,
        "short_stalled_share": len(stalled) / len(short) if short else None,
        "long_ttft_p50_ms": _pct(ttft(long), 0.5),
        "long_ttft_max_ms": max(ttft(long), default=None),
        "long_itl_p50_ms": _pct(itl(long), 0.5),
        "mean_tokens": statistics.fmean([len(r["tokens"]) for r in ok]) if ok else 0,
        "routes": routes,
    }


def run_setup(
    setup: Setup,
    spec: Spec,
    router_cpus: Collection[int] | None,
    other_cpus: Collection[int] | None,
) -> dict[str, Any]:
    with Stack() as st:
        wd = st.workdir
        if setup.disaggregated:
            pre = st.sim(
                "mx-prefill",
                *_sim_args(spec, setup.budget, "--kv-connector", "nixl"),
                cpus=other_cpus,
            )
            dec = st.sim(
                "mx-decode",
                *_sim_args(spec, setup.budget, "--kv-connector", "nixl"),
                cpus=other_cpus,
            )
            pools = static_pools([pre.url()], [dec.url()])
            threshold = spec.threshold
        else:
            e1 = st.sim("mx-engine-1", *_sim_args(spec, setup.budget), cpus=other_cpus)
            e2 = st.sim("mx-engine-2", *_sim_args(spec, setup.budget), cpus=other_cpus)
            # prefill pool unused: nothing reaches the threshold
            pools = static_pools([e1.url()], [e1.url(), e2.url()])
            threshold = 1 << 30
        cfg = _router_config(
            wd,
            "mx-router",
            {
                "routing": {"connector": "nixl", "threshold": threshold},
                "pools": pools,
                "limits": {"maxInFlight": 1024, "maxQueued": 1024},
            },
        )
        router = st.router("mx-router", cfg, cpus=router_cpus)
        _wait_ready(router.url())
        recs = asyncio.run(_drive(router.url() + "/v1/completions", spec))
    return {"kind": "mixed", "setup": setup.name, **_summary(recs, spec), "spec": asdict(spec)}


def _wait_ready(base: str, timeout: float = 30.0) -> None:
    """Until the router sees a healthy decoder (its first health round)."""
    import urllib.error
    import urllib.request

    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{base}/ready never answered 200")
        time.sleep(0.05)


def run(
    spec: Spec,
    router_cpus: Collection[int] | None,
    other_cpus: Collection[int] | None,
    log: Any = print,
) -> list[dict[str, Any]]:
    rows = []
    for setup in SETUPS:
        row = run_setup(setup, spec, router_cpus, other_cpus)
        log(
            f"  mixed: {setup.name:58s} short ITL p99 {_fmt(row['short_itl_p99_ms'])} ms, "
            f"long TTFT p50 {_fmt(row['long_ttft_p50_ms'])} ms, errors {row['errors']}"
        )
        rows.append(row)
    return rows


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
