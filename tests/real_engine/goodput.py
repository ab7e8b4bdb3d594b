"""``python -m tests.real_engine.goodput`` (``make goodput``): the goodput sweep
(pd_router_dev.goodput) on real engines: two of vLLM's CPU build serving the tiny dense model,
started as the chart renders the flexible layout (``tests/scenarios/flexible.yaml``: NixlConnector
``kv_both``, so the same two engines serve every configuration), each pinned to its own core,
with this tier's CPU changes (tests/real_engine/engines.py). The routers run from the chart's
router config, their pools and decision set per configuration. Then the simulated sweep at GPU
scale (``pd_router_dev.goodput.sim``), and the table and the heatmap of both.

What the machine does to the figures: the two engines take both cores; the router and the load
generator run on the same cores (unpinned), as they would not on a GPU node. They do the same
work per request in every configuration but the split ones (a hand-off is two engine calls),
so this favours the colocated configuration a little."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pd_router_dev.devstack import Proc, Stack
from pd_router_dev.goodput import report, sweep, workload
from pd_router_dev.goodput import sim as simulated

from tests.real_engine import engines
from tests.real_engine.routers import chart_router_config

RENDER = "scenario:flexible"
ROLE = "decode"  # the flexible layout's one pool


class RealBackend:
    def __init__(self, workdir: Path) -> None:
        version, _ = engines.cpu_build()
        self.name = f"vLLM {version} (CPU build), 2 engines"
        self.workdir = workdir
        self.stack = Stack(workdir)
        self.pair = [engines.engine(ROLE, "dense", core, workdir, render=RENDER) for core in (0, 1)]
        for e in self.pair:
            e.start()
        engines.wait_ready(self.pair)
        self.engines = [e.url for e in self.pair]
        self.model = chart_router_config(RENDER)["model"]["servedName"]

    def base_config(self) -> dict[str, Any]:
        cfg = chart_router_config(RENDER)
        cfg["listen"] = {"host": "127.0.0.1", "port": 0, "workers": 1}
        cfg["logging"] = {"level": "info", "logPrompts": False}  # the access lines name engines
        cfg["health"]["intervalSeconds"] = 2
        cfg["model"]["tokenizer"] = str(engines.model("dense") / "tokenizer.json")
        cfg["model"].pop("tokenizerHub", None)
        # engines on one host publish KV events on ports of their own (engines.cpu_command)
        cfg["routing"]["kvEvents"].update(port=0, replayPort=0)
        return cfg

    def start_router(self, name: str, config: dict[str, Any]) -> Proc:
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return self.stack.router(
            name, path, env={k: v for k, v in os.environ.items() if not k.startswith("PD_ROUTER__")}
        )

    def counters(self, url: str) -> tuple[float, float]:
        text = engines.metrics_text(url)
        return (
            engines.value(text, "vllm:prompt_tokens_by_source_total", source="local_compute"),
            engines.value(text, "vllm:generation_tokens_total"),
        )

    def describe(self) -> str:
        return (
            f"{self.name}: the tiny dense model (tests/engines/harness/tiny_model.py, float32), "
            "NixlConnector kv_both over UCX in host memory, each engine pinned to one of the "
            "machine's two cores; the router (one process) and the load generator unpinned on "
            "the same cores"
        )

    def stop(self) -> None:
        self.stack.stop()
        for e in self.pair:
            e.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.real_engine.goodput", description=__doc__.split("\n\n")[0])
    # the grid's options (--mixes, --fractions, --no-extras) apply to both runs; the durations to
    # the real engines' only (the simulated run's are in its slowed time: pd_router_dev.goodput.sim)
    p.add_argument("--duration", type=float, default=30.0, help="counted seconds of arrivals per cell (real engines)")
    p.add_argument(
        "--warmup", type=float, default=5.0, help="seconds of arrivals before them, not counted (real engines)"
    )
    p.add_argument("--out", default="bench-results", help="folder for goodput-*.json and goodput.md")
    p.add_argument("--picture", default="docs/goodput.png", help="the heatmap (PNG)")
    p.add_argument("--no-sim", action="store_true", help="the real engines only")
    p.add_argument("--sim-engines", type=int, default=8)
    p.add_argument("--mixes", default=",".join(m.name for m in workload.MIXES), help="the prompt mixes of the grid")
    p.add_argument(
        "--cells",
        type=sweep.cells_arg,
        default=sweep.CELLS,
        help=f"what to run, of {','.join(sweep.CELLS)} (default all; the capacity of --mixes is measured anyway)",
    )
    p.add_argument("--no-extras", action="store_true", help="skip the chat and alternating workloads (--cells grid)")
    p.add_argument(
        "--fractions",
        type=sweep.fractions_arg,
        default=sweep.RATE_FRACTIONS,
        help="the arrival rates of the grid, as fractions of the colocated capacity",
    )
    p.add_argument("--sim-only", action="store_true", help="the simulated engines only")
    a = p.parse_args(argv)
    if a.no_extras and a.cells != sweep.CELLS:
        p.error("--no-extras and --cells: give one (--no-extras is --cells grid)")
    cells = ("grid",) if a.no_extras else a.cells
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    results = []
    if not a.sim_only:
        work = out / "goodput-real"
        work.mkdir(exist_ok=True)
        log("goodput: starting two vLLM engines (flexible layout, kv_both), about a minute")
        backend = RealBackend(work)
        try:
            opts = sweep.Options(
                duration=a.duration,
                warmup=a.warmup,
                mixes=tuple(a.mixes.split(",")),
                cells=cells,
                fractions=a.fractions,
            )
            results.append(sweep.Sweep(backend, opts, out, log).run())
        finally:
            backend.stop()
        (out / "goodput-real.json").write_text(json.dumps(results[-1], indent=1))
    if not a.no_sim:
        fractions = ",".join(f"{f:g}" for f in a.fractions)
        grid = ["--mixes", a.mixes, "--fractions", fractions, "--cells", ",".join(cells)]
        simulated.main(["--engines", str(a.sim_engines), "--out", str(out), *grid])
        results.append(json.loads((out / "goodput-sim.json").read_text()))
    md = "\n".join(report.table(r) for r in results)
    (out / "goodput.md").write_text(md)
    print(md)
    if a.picture:
        report.heatmap(results, Path(a.picture))
        log(f"goodput: heatmap written to {a.picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
