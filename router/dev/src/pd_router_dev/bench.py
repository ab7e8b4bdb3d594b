"""``make bench``: our router vs the Rust ``vllm-router`` vs engines directly, one run.

Zero-delay simulated engines; targets measured alternately cell by cell (concurrency x
streaming): the engine directly, our router on its direct route, our router disaggregated
with NIXL and with LMCache, and ``vllm-router`` (PyPI) in ``--vllm-pd-disaggregation`` mode
(round_robin) against the same NIXL engines. Reports p50/p99 latency and the latency added
over the engine, requests/s, and router CPU time per request (utime+stime from /proc).
The load generator is a separate uvloop/aiohttp process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pd_router_dev.devstack import (
    DEMO_CONFIG,
    Stack,
    free_port,
    vllm_router_binary,
    vllm_router_command,
)

MODEL = "llama-3.3-70b"
PROMPT = "Explain in one paragraph why long prompts should be prefilled on separate engines."
CLK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- load generator
async def _loadgen(url: str, conc: int, duration: float, stream: bool, warmup: float) -> dict:
    import aiohttp

    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    hdrs = {"Content-Type": "application/json"}
    lat: list[float] = []
    errors = 0
    done_all = 0
    count_from = time.perf_counter() + warmup
    end = count_from + duration
    conn = aiohttp.TCPConnector(limit=conc, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal errors, done_all
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    return
                try:
                    async with s.post(url, data=body, headers=hdrs) as r:
                        if stream:
                            async for _ in r.content.iter_any():
                                pass
                        else:
                            await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                t1 = time.perf_counter()
                done_all += 1
                if t0 >= count_from and t1 <= end:
                    if ok:
                        lat.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(conc)))
    lat.sort()
    n = len(lat)
    return {
        "n": n,
        "n_all": done_all,
        "errors": errors,
        "rps": n / duration,
        "p50": lat[n // 2] * 1000 if n else float("nan"),
        "p99": lat[min(n - 1, int(n * 0.99))] * 1000 if n else float("nan"),
        "mean": statistics.fmean(lat) * 1000 if n else float("nan"),
    }


def loadgen_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--conc", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--stream", action="store_true")
    a = p.parse_args(argv)
    import uvloop

    res = uvloop.run(_loadgen(a.url, a.conc, a.duration, a.stream, a.warmup))
    print(json.dumps(res))
    return 0


# --------------------------------------------------------------------------- orchestration
def _cpu_seconds(pid: int) -> float:
    """utime+stime of a process and all its descendants (threads included)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(k) for k in kids]
        except (OSError, IndexError, ValueError):
            continue
    return total


def _router_config(workdir: Path, name: str, over: dict[str, Any]) -> Path:
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    cfg["logging"] = {"level": "warning", "logPrompts": False}
    cfg["health"] = {**cfg["health"], "intervalSeconds": 5}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{url} never came up") from None
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "loadgen":
        return loadgen_main(argv[1:])
    p = argparse.ArgumentParser(prog="pd_router_dev.bench", description=__doc__)
    p.add_argument("--duration", type=float, default=2.5, help="measured seconds per cell")
    p.add_argument("--concurrency", default="1,32,256")
    p.add_argument("--out", help="also write the markdown table here")
    a = p.parse_args(argv)
    concs = [int(c) for c in a.concurrency.split(",")]
    lines: list[str] = []
    with Stack() as st:
        wd = st.workdir
        nx_pre = st.sim("b-nx-prefill", "--kv-connector", "nixl")
        nx_dec = st.sim("b-nx-decode", "--kv-connector", "nixl")
        notify, ip, ap = free_port(), free_port(), free_port()
        lm_pre = st.sim(
            "b-lm-prefill",
            "--kv-connector",
            "lmcache",
            "--lmcache-role",
            "sender",
            "--pd-proxy-port",
            str(notify),
        )
        lm_dec = st.sim(
            "b-lm-decode",
            "--kv-connector",
            "lmcache",
            "--lmcache-role",
            "receiver",
            "--pd-peer-init-port",
            str(ip),
            "--pd-peer-alloc-port",
            str(ap),
        )
        nx_pools = {
            "prefill": {"discovery": "static", "static": [nx_pre.url()]},
            "decode": {"discovery": "static", "static": [nx_dec.url()]},
        }
        limits = {"maxInFlight": 1024, "maxQueued": 1024}
        r_direct = st.router(
            "b-ours-direct",
            _router_config(
                wd,
                "b-ours-direct",
                {
                    "routing": {"connector": "nixl", "threshold": 1 << 30},
                    "pools": nx_pools,
                    "limits": limits,
                },
            ),
        )
        r_nixl = st.router(
            "b-ours-nixl",
            _router_config(
                wd,
                "b-ours-nixl",
                {
                    "routing": {"connector": "nixl", "threshold": 0},
                    "pools": nx_pools,
                    "limits": limits,
                },
            ),
        )
        r_lm = st.router(
            "b-ours-lmcache",
            _router_config(
                wd,
                "b-ours-lmcache",
                {
                    "routing": {"connector": "lmcache", "threshold": 0},
                    "pools": {
                        "prefill": {"discovery": "static", "static": [lm_pre.url()]},
                        "decode": {"discovery": "static", "static": [lm_dec.url()]},
                    },
                    "lmcache": {
                        "notifyPort": notify,
                        "decoderInitPorts": [ip],
                        "decoderAllocPorts": [ap],
                        "notifyBindHost": "127.0.0.1",
                    },
                    "limits": limits,
                },
            ),
        )
        targets: list[tuple[str, str, int | None]] = [
            ("engine (no router)", nx_dec.url(), None),
            ("ours: direct route", r_direct.url(), r_direct.pid),
            ("ours: disagg nixl", r_nixl.url(), r_nixl.pid),
            ("ours: disagg lmcache", r_lm.url(), r_lm.pid),
        ]
        vr_note = ""
        vr_proc: subprocess.Popen[bytes] | None = None
        if vllm_router_binary().exists():
            port = free_port()
            vr_log = open(wd / "vllm-router.log", "wb")  # noqa: SIM115
            vr_proc = subprocess.Popen(
                vllm_router_command(
                    nx_pre.url(),
                    nx_dec.url(),
                    port,
                    "--max-concurrent-requests",
                    "1024",
                    "--queue-size",
                    "1024",
                ),
                stdout=vr_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                _wait_http(f"http://127.0.0.1:{port}/health", vr_proc)
                targets.append(
                    ("vllm-router 0.1.17: disagg nixl", f"http://127.0.0.1:{port}", vr_proc.pid)
                )
            except RuntimeError as exc:
                vr_note = f"vllm-router did not start: {exc}"
        else:
            vr_note = "vllm-router is not installed (pip install 'pd-router[test]')"
        try:
            results: dict[tuple[str, int, bool], dict] = {}
            for conc in concs:
                for stream in (False, True):
                    for name, base, pid in targets:
                        cpu0 = _cpu_seconds(pid) if pid else 0.0
                        out = subprocess.run(
                            [
                                sys.executable,
                                "-m",
                                "pd_router_dev.bench",
                                "loadgen",
                                "--url",
                                base + "/v1/chat/completions",
                                "--conc",
                                str(conc),
                                "--duration",
                                str(a.duration),
                            ]
                            + (["--stream"] if stream else []),
                            capture_output=True,
                            text=True,
                            check=True,
                        )
                        res = json.loads(out.stdout)
                        cpu1 = _cpu_seconds(pid) if pid else 0.0
                        # CPU over the whole loadgen run / every request it completed
                        res["cpu_ms"] = (
                            (cpu1 - cpu0) * 1000 / max(1, res["n_all"]) if pid else float("nan")
                        )
                        results[(name, conc, stream)] = res
                        print(
                            f"  {name:32s} c={conc:<3d} stream={stream!s:5s} "
                            f"{res['rps']:8.0f} req/s p50 {res['p50']:7.2f} ms",
                            flush=True,
                        )
        finally:
            if vr_proc is not None:
                vr_proc.terminate()
                try:
                    vr_proc.wait(5)
                except subprocess.TimeoutExpired:
                    vr_proc.kill()
        lines.append(
            "| target | clients | stream | req/s | p50 ms | p99 ms | added p50 ms "
            "| added p99 ms | router CPU ms/req | errors |"
        )
        lines.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for conc in concs:
            for stream in (False, True):
                base_res = results[(targets[0][0], conc, stream)]
                for name, _, pid in targets:
                    r = results[(name, conc, stream)]
                    add50 = r["p50"] - base_res["p50"] if pid else 0.0
                    add99 = r["p99"] - base_res["p99"] if pid else 0.0
                    cpu = f"{r['cpu_ms']:.3f}" if pid else "-"
                    lines.append(
                        f"| {name} | {conc} | {'yes' if stream else 'no'} | {r['rps']:.0f} | "
                        f"{r['p50']:.2f} | {r['p99']:.2f} | {add50:+.2f} | {add99:+.2f} | "
                        f"{cpu} | {r['errors']} |"
                    )
        sat = max(concs)
        lines.append("")
        lines.append(
            f"Saturated req/s (c={sat}, non-streaming): "
            + ", ".join(f"{n}: {results[(n, sat, False)]['rps']:.0f}" for n, _, _ in targets)
        )
        vr_name = next((n for n, _, _ in targets if n.startswith("vllm-router")), None)
        if vr_name:
            ours, theirs = (
                results[("ours: disagg nixl", sat, False)],
                results[(vr_name, sat, False)],
            )
            lines.append(
                f"Ratios ours(nixl)/vllm-router at c={sat}: req/s {ours['rps'] / theirs['rps']:.2f}"
                f", CPU/req {ours['cpu_ms'] / theirs['cpu_ms']:.2f}"
            )
        if vr_note:
            lines.append(f"Peer missing: {vr_note}")
        lines.append(
            f"({os.cpu_count()} CPUs; engines, routers and the load generator share "
            "them; zero-delay engines; 16 output tokens; chat completions)"
        )
    table = "\n".join(lines)
    print()
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
