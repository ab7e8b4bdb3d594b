"""``python -m pd_router_dev.goodput.sim``: the goodput sweep on simulated engines at a scale the
CPU machines cannot host with vLLM (8 engines by default), each engine timed as vLLM serving
Llama-3.1-8B in BF16 on one H100, from public figures:

- prefill: 0.0238 ms per prompt token: the linear term of a fit to vLLM's single-request TTFT
  against prompt length on one H100 (vLLM blog, 2026-01-08, "KV offloading connector", Fig. 1:
  10K tokens about 263 ms, 20K about 638 ms; TTFT = 4.50e-7 n^2 + 0.0238 n - 19 ms over
  4K-100K; the quadratic term is under 5 % below 4K tokens, where the sweep's prompts are);
- decode step: 6.44 ms at batch 1 (vLLM blog, 2026-04-22, "FP8 KV-cache", text under Fig. 2:
  6.44 ms + 4.37e-5 ms per context token, Llama-3.1-8B, H100, vLLM 0.19.1), plus 0.1 ms per
  sequence in the batch (no public vLLM figure pins this term; 0.03-0.2 ms fit the batch-8
  figures of vLLM's CI latency benchmark, 7.8-8.2 ms per step);
- chunked prefill with vLLM 0.31's default budget for the API server on an H100, 8192 tokens
  per step (``engine/arg_utils.py``), and the step time as a roofline (the larger of the
  compute- and memory-bound times, ``sim/engine.py``);
- the KV hand-off: 30 ms (a 2,000-3,200-token prompt at 11 us per token, the end-to-end NIXL
  transfer llm-d measured for Llama-3.1-8B over 200 Gb/s: 4 GB in about 360 ms, llm-d v0.5
  blog; 128 KiB of KV per token).

**Time runs ``--slow-down`` times slower** (default 20) than on the GPUs, and the arrival
rates are that many times lower: every engine time above is multiplied by it, so that the
router, the eight simulated engines and the load generator keep up on two cores (their own
costs, a millisecond or less per request, stay small against the stretched engine times). The
report converts back: rates and goodput per GPU-second, SLOs in GPU milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pd_router_dev.devstack import DEMO_CONFIG, Proc, Stack
from pd_router_dev.goodput import report, sweep, workload

MODEL = "llama-3.1-8b"
PREFILL_MS_PER_TOKEN = 0.0238
DECODE_STEP_MS = 6.44
DECODE_STEP_MS_PER_SEQ = 0.1
TRANSFER_MS = 30.0
BUDGET = 8192


class SimBackend:
    def __init__(self, stack: Stack, engines: int, slow_down: float) -> None:
        self.stack = stack
        self.n = engines
        self.scale = slow_down
        self.name = f"simulated, {engines} engines"
        self.model = MODEL
        self.chunk_tokens = BUDGET
        f = slow_down
        args = [
            "--model", MODEL,
            "--kv-connector", "nixl",
            "--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN * f),
            "--decode-step-ms", str(DECODE_STEP_MS * f),
            "--decode-step-ms-per-seq", str(DECODE_STEP_MS_PER_SEQ * f),
            "--transfer-ms", str(TRANSFER_MS * f),
            "--step-time", "max",
            "--max-num-batched-tokens", str(BUDGET),
            "--max-model-len", "32768",
        ]  # fmt: skip
        self.engines = [stack.sim(f"engine-{i}", *args).url() for i in range(engines)]

    def base_config(self) -> dict[str, Any]:
        cfg = yaml.safe_load(DEMO_CONFIG.read_text())
        cfg["model"]["servedName"] = MODEL
        cfg["listen"] = {"host": "127.0.0.1", "port": 0, "workers": 1}
        cfg["logging"] = {"level": "info", "logPrompts": False}  # the access lines name engines
        cfg["health"] = {**cfg.get("health", {}), "intervalSeconds": 2}
        cfg["routing"].update(
            connector="nixl", sessionAffinityHeader="", kvEvents={"enabled": False}
        )
        cfg.pop("lmcache", None)
        # stretched engines: the router's timeouts stretch with them
        cfg["timeouts"] = {
            **cfg.get("timeouts", {}),
            "prefillSeconds": 600,
            "firstByteSeconds": 600,
        }
        return cfg

    def start_router(self, name: str, config: dict[str, Any]) -> Proc:
        path = self.stack.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return self.stack.router(name, path)

    def counters(self, url: str) -> tuple[float, float]:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        prompt = gen = 0.0
        for line in text.splitlines():
            if (
                line.startswith("vllm:prompt_tokens_by_source_total")
                and 'source="local_compute"' in line
            ):
                prompt += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:generation_tokens_total"):
                gen += float(line.rsplit(" ", 1)[1])
        return prompt, gen

    def describe(self) -> str:
        return (
            f"{self.n} simulated vLLM engines timed as Llama-3.1-8B BF16 on one H100 each "
            f"(prefill {PREFILL_MS_PER_TOKEN} ms/token, decode step {DECODE_STEP_MS} ms + "
            f"{DECODE_STEP_MS_PER_SEQ} ms/sequence, chunked prefill {BUDGET} tokens/step, KV "
            f"hand-off {TRANSFER_MS:g} ms; sources in pd_router_dev/goodput/sim.py), run "
            f"{self.scale:g} x slower than a GPU and reported back in GPU time; the router "
            "(one process) and the load generator on the same two cores"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pd_router_dev.goodput.sim", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--slow-down", type=float, default=20.0)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="counted seconds per cell, in slowed time (default: 2 x the slow-down: 2 GPU-seconds)",
    )
    p.add_argument("--warmup", type=float, default=None)
    p.add_argument("--mixes", default=",".join(m.name for m in workload.MIXES))
    p.add_argument(
        "--fractions",
        type=sweep.fractions_arg,
        default=sweep.RATE_FRACTIONS,
        help="the arrival rates of the grid, as fractions of the colocated capacity",
    )
    p.add_argument(
        "--cells",
        type=sweep.cells_arg,
        default=sweep.CELLS,
        help=f"what to run, of {','.join(sweep.CELLS)} (default all)",
    )
    p.add_argument(
        "--no-extras", action="store_true", help="skip the chat and alternating workloads"
    )
    p.add_argument("--out", default="bench-results", help="folder for goodput-*.json and .md")
    p.add_argument("--picture", default="", help="write the heatmap here too (PNG)")
    a = p.parse_args(argv)
    if a.no_extras and a.cells != sweep.CELLS:
        p.error("--no-extras and --cells: give one (--no-extras is --cells grid)")
    if a.engines < 2:
        p.error("--engines: at least 2 (a split needs a prefiller and a decoder)")
    f = a.slow_down
    opts = sweep.Options(
        duration=a.duration if a.duration is not None else 2.0 * f,
        warmup=a.warmup if a.warmup is not None else 0.4 * f,
        capacity_seconds=2.0 * f,
        # an H100 batches hundreds of streams: fewer clients would measure the clients
        clients_per_engine=32,
        mixes=tuple(a.mixes.split(",")),
        cells=("grid",) if a.no_extras else a.cells,
        fractions=a.fractions,
    )
    out = Path(a.out)
    with Stack() as stack:
        backend = SimBackend(stack, a.engines, f)
        result = sweep.Sweep(
            backend, opts, out, log=lambda s: print(s, file=sys.stderr, flush=True)
        ).run()
    result = sweep.in_gpu_time(result, f)
    out.mkdir(parents=True, exist_ok=True)  # run alone (not from tests.real_engine.goodput)
    (out / "goodput-sim.json").write_text(json.dumps(result, indent=1))
    md = report.table(result)
    (out / "goodput-sim.md").write_text(md)
    print(md)
    if a.picture:
        report.heatmap([result], Path(a.picture))
    return 0


if __name__ == "__main__":
    sys.exit(main())
