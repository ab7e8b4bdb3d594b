"""The sweep on one set of engines (any :class:`Backend`): calibrate the SLOs on the idle
engines, measure colocated capacity per mix, then run every cell on each configuration in
turn, the same arrivals for all three:

- ``colocated``: every engine serves whole requests (one flexible pool, ``decision: prefix``
  with a threshold no prompt reaches: the prefix-aware choice of engine, nothing split);
- ``split``: today's fixed pools, half the engines prefill and half decode (``pools.layout:
  split``, ``decision: prefix``, the chart's default threshold 1024);
- ``goodput``: one flexible pool and ``decision: goodput`` with the run's SLOs.

Cells: 3 mixes x 3 Poisson rates (0.3, 0.6 and 0.9 of the colocated capacity of that mix),
a multi-turn chat, and an alternating workload (short-only and long-heavy phases); for the
last, every engine's prompt tokens computed and tokens generated are read from its own metrics
every second (who prefilled, who decoded, as the mix moved)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pd_router_dev.devstack import Proc
from pd_router_dev.goodput import client, slo, workload
from pd_router_dev.goodput.client import Record
from pd_router_dev.goodput.slo import Slo, Unloaded

SETUPS = ("colocated", "split", "goodput")
RATE_FRACTIONS = (0.3, 0.6, 0.9)


def fractions_arg(text: str) -> tuple[float, ...]:
    """``--fractions``: comma-separated arrival rates, each a fraction of the colocated
    capacity in (0, 2] (an argparse ``type``: a bad one is a usage error naming the option)."""
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers: {text!r}") from None
    if not out or not all(0 < f <= 2 for f in out):
        raise argparse.ArgumentTypeError(f"each must be in (0, 2]: {text!r}")
    return out


CELLS = ("grid", "chat", "alternating")  # what a run holds (--cells); all by default


def cells_arg(text: str) -> tuple[str, ...]:
    """``--cells``: comma-separated, of ``CELLS`` (an argparse ``type``: a bad one is a usage
    error naming the option). Without ``grid`` the colocated capacity of ``--mixes`` is still
    measured: the extras' rates follow it."""
    out = tuple(x for x in text.split(",") if x)
    bad = [x for x in out if x not in CELLS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"each of {', '.join(CELLS)}: {text!r}")
    return out


NEVER = 1 << 30  # a threshold no prompt reaches: colocated serving
SPLIT_THRESHOLD = 1024  # the chart's router.threshold default: today's decision


class Backend(Protocol):
    name: str
    model: str
    engines: list[str]  # base URLs

    def base_config(self) -> dict[str, Any]:
        """A router config for these engines (listen, model, tokenizer, KV events...)."""

    def start_router(self, name: str, config: dict[str, Any]) -> Proc: ...

    def counters(self, url: str) -> tuple[float, float]:
        """(prompt tokens computed, tokens generated) by that engine so far."""

    def describe(self) -> str: ...


@dataclass
class Options:
    duration: float = 30.0  # seconds of counted arrivals per cell
    warmup: float = 5.0  # arrivals before it are sent, not counted
    capacity_seconds: float = 20.0
    clients_per_engine: int = 8  # closed-loop clients per engine when measuring capacity
    seed: int = 33
    mixes: tuple[str, ...] = tuple(m.name for m in workload.MIXES)
    cells: tuple[str, ...] = CELLS  # the grid, the multi-turn chat, the alternating workload
    fractions: tuple[float, ...] = RATE_FRACTIONS


@dataclass
class Cell:
    workload: str
    rate: float  # requests per second offered (chat: turns per second, roughly)
    fraction: str  # of the colocated capacity: "0.3", ... or "" for the extras
    goodput: dict[str, float] = field(default_factory=dict)  # setup -> good req/s
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # alternating: phase -> setup -> gp
    timeline: list[dict[str, Any]] = field(default_factory=list)  # alternating, goodput setup

    def ratio(self) -> float | None:
        best = max(self.goodput.get("colocated", 0.0), self.goodput.get("split", 0.0))
        new = self.goodput.get("goodput")
        if new is None:
            return None
        return new / best if best > 0 else (1.0 if new == 0 else float("inf"))


def router_configs(
    backend: Backend, s: Slo, interference: float = 1.0
) -> dict[str, dict[str, Any]]:
    """The three configurations of every cell. The goodput decision is seeded with what the run
    measured of the engines, as a user would set it: their chunk budget and their crowding
    (``interference - 1``: how much slower an engine decodes while the others work)."""
    base = backend.base_config()
    engines = backend.engines
    half = max(1, len(engines) // 2)
    out = {}
    c = copy.deepcopy(base)
    c["pools"] = {"layout": "flexible", "decode": {"discovery": "static", "static": engines}}
    c["routing"].update(decision="prefix", threshold=NEVER)
    out["colocated"] = c
    c = copy.deepcopy(base)
    c["pools"] = {
        "layout": "split",
        "prefill": {"discovery": "static", "static": engines[:half]},
        "decode": {"discovery": "static", "static": engines[half:]},
    }
    c["routing"].update(decision="prefix", threshold=SPLIT_THRESHOLD)
    out["split"] = c
    c = copy.deepcopy(base)
    c["pools"] = {"layout": "flexible", "decode": {"discovery": "static", "static": engines}}
    seed = {
        "chunkTokens": getattr(backend, "chunk_tokens", 0),  # the engines' budget a step
        "crowding": crowding(interference),
    }
    c["routing"].update(decision="goodput", goodput={**s.router(), "seed": seed})
    out["goodput"] = c
    return out


def access_lines(router: Proc) -> dict[str, dict[str, Any]]:
    """The router's access lines (pd_router.logs.AccessLog) by request id."""
    out = {}
    for line in router.log.read_text(errors="replace").splitlines():
        if '"msg":"request"' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec.get("request_id", "")] = rec
    return out


def model_beliefs(url: str) -> dict[str, float]:
    """``pd_router_engine_cost`` of a router: what its cost model believes, by engine and
    quantity."""
    out = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("pd_router_engine_cost{"):
            labels, _, value = line.rpartition(" ")
            out[labels[len("pd_router_engine_cost") :]] = float(value)
    return out


def words_per_token(url: str, model: str) -> float:
    """Words of the workload's vocabulary per token, from the engine's own /tokenize."""
    import random

    text = workload.text(random.Random(0), 1000, 1.0)
    req = urllib.request.Request(
        url + "/tokenize",
        json.dumps({"model": model, "prompt": text}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        count = json.loads(r.read())["count"]
    return 1000 / count


def interference(urls: list[str], model: str, wpt: float) -> float:
    """How much slower the first engine decodes while the others are busy too: the median gap
    of 8 streams on it alone, then with 8 streams on every engine at once (1: engines that do
    not share anything; the real tier's two share a 2-vCPU machine)."""
    import random

    rng = random.Random(7)

    def streams(url: str) -> list[workload.Request]:
        out = []
        for _ in range(8):
            body = {
                "model": model,
                "prompt": workload.text(rng, 60, wpt),
                "max_tokens": 96,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "cache_salt": f"interference-{rng.random()}",
            }
            out.append(workload.Request(0.0, "/v1/completions", body, False))
        return out

    async def gaps(per_engine: dict[str, list[workload.Request]]) -> list[float]:
        runs = await asyncio.gather(*(client.drive(u, rs) for u, rs in per_engine.items()))
        first = runs[0]
        return [g for r in first for g in r.gaps[4:]]

    first = urls[0]
    alone = statistics.median(asyncio.run(gaps({first: streams(first)})))
    together = statistics.median(asyncio.run(gaps({u: streams(u) for u in urls})))
    return together / alone


def crowding(interference: float) -> float:
    """The goodput decision's ``seed.crowding`` for engines measured by :func:`interference`:
    how much slower one decodes while the others work."""
    return round(max(0.0, interference - 1.0), 2)


def calibrate(url: str, model: str, wpt: float, seed: int) -> Unloaded:
    """Requests sent one at a time to idle engines: TTFT against prompt tokens, and the gaps
    of lone streams."""
    import random

    rng = random.Random(seed)
    reqs = []
    for tokens in (100, 500, 1000, 2000, 3000):
        for _ in range(5):
            body = {
                "model": model,
                "prompt": workload.text(rng, tokens, wpt),
                "max_tokens": 32,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            reqs.append(workload.Request(0.0, "/v1/completions", body, tokens > 1000))

    async def one_by_one() -> list[Record]:
        out = []
        for r in reqs:
            out.append((await client.drive(url, [r]))[0])
        return out

    recs = asyncio.run(one_by_one())
    bad = [r for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"calibration requests failed: {bad[0].error}")
    recs = recs[2:]  # the first two warm the engines up
    # the median TTFT of each length (a request slowed by something else weighs nothing)
    by: dict[int, list[Record]] = {}
    for r in recs:
        by.setdefault(round(r.prompt_tokens, -2), []).append(r)
    points = [
        (
            statistics.median(r.prompt_tokens for r in rs),
            statistics.median(r.ttft or 0.0 for r in rs),
        )
        for rs in by.values()
    ]
    return Unloaded.fit(points, [g for r in recs for g in r.gaps])


def _summary(s: Slo, recs: list[Record], start: float, end: float) -> dict[str, Any]:
    counted = [r for r in recs if start <= r.at < end]
    good = [r for r in counted if s.good(r)]
    reasons: dict[str, int] = {}
    for r in counted:
        reasons[r.reason or "?"] = reasons.get(r.reason or "?", 0) + 1
    errs = slo.prediction_errors(counted)
    ok = [r for r in counted if r.ok]
    return {
        "requests": len(counted),
        "good": len(good),
        "failed": len(counted) - len(ok),
        # served by one engine after a hand-off was started: prefilled twice
        "fallbacks": sum(1 for r in counted if r.route == "fallback"),
        "ttft_miss": sum(1 for r in ok if (r.ttft or 0) > s.ttft_bound(r.prompt_tokens)),
        "itl_miss": sum(1 for r in ok if r.itl_p95() > s.itl),
        "reasons": reasons,
        "prediction_error_p50": statistics.median(errs) if errs else None,
        "predictions": len(errs),
    }


class Sweep:
    def __init__(
        self, backend: Backend, opts: Options, out: Path, log: Callable[[str], None] = print
    ) -> None:
        self.b = backend
        self.o = opts
        self.out = out
        self.log = log
        self.routers: dict[str, Proc] = {}
        self.cells: list[Cell] = []
        self.records: dict[str, list[dict[str, Any]]] = {}
        # what the goodput decision's cost model believed of each engine after each cell
        self.beliefs: dict[str, dict[str, float]] = {}

    def run(self) -> dict[str, Any]:
        b, o = self.b, self.o
        t_start = time.time()
        self.wpt = words_per_token(b.engines[0], b.model)
        self.interference = interference(b.engines, b.model, self.wpt)
        self.log(
            f"{b.name}: an engine decodes {self.interference:.2f} x slower while the others "
            "are busy"
        )
        cal = b.start_router("calibrate", router_configs(b, Slo(1, 0, 1))["colocated"])
        try:
            self.unloaded = calibrate(cal.url(), b.model, self.wpt, o.seed)
        finally:
            cal.stop()
        self.slo = Slo.of(self.unloaded, workload.LONGEST_SHORT)
        self.log(
            f"{b.name}: unloaded TTFT {self.unloaded.ttft * 1000:.1f} ms + "
            f"{self.unloaded.ttft_per_token * 1e6:.2f} ms/1k tokens, "
            f"ITL {self.unloaded.itl * 1000:.1f} ms; "
            f"SLO {self.slo.describe()}"
        )
        for name, cfg in router_configs(b, self.slo, self.interference).items():
            self.routers[name] = b.start_router(name, cfg)
        try:
            self.capacity = {m.name: self._capacity(m) for m in workload.MIXES if m.name in o.mixes}
            for m in workload.MIXES:
                if m.name not in o.mixes or "grid" not in o.cells:
                    continue
                for i, f in enumerate(o.fractions):
                    self._grid_cell(m, f, i)
            if "chat" in o.cells:
                self._chat_cell()
            if "alternating" in o.cells:
                self._alternating_cell()
        finally:
            for p in self.routers.values():
                p.stop()
        return self.result(time.time() - t_start)

    # ------------------------------------------------------------------ cells
    def _capacity(self, mix: workload.Mix) -> float:
        import random

        rng = random.Random(self.o.seed + 1000)
        b = self.b

        def make(i: int) -> workload.Request:  # prompts of their own (no cell finds them cached)
            return workload.unshared(
                workload.one(rng, mix, b.model, self.wpt, 0.0), f"capacity {mix.name}"
            )

        clients = self.o.clients_per_engine * len(b.engines)
        cap = asyncio.run(
            client.closed_loop(
                self.routers["colocated"].url(), make, clients, self.o.capacity_seconds
            )
        )
        self.log(
            f"{b.name}: colocated capacity, {mix.name}: {cap:.2f} req/s "
            f"({clients} closed-loop clients)"
        )
        return cap

    def _order(self, k: int) -> list[str]:
        """Setups in turn, rotated per cell: none always runs first (or last)."""
        return [SETUPS[(i + k) % 3] for i in range(3)]

    def _run(
        self, setup: str, reqs: list[workload.Request], chats: list[workload.Session] | None = None
    ) -> list[Record]:
        router = self.routers[setup]
        tag = f"{setup} {len(self.cells)}"  # nothing cached by another configuration or cell
        recs = asyncio.run(
            client.drive(
                router.url(), copy.deepcopy(reqs), copy.deepcopy(chats or []), self.b.model, tag
            )
        )
        if setup == "goodput":
            self.beliefs[f"{len(self.cells)}"] = model_beliefs(router.url())
        lines = access_lines(router)
        for r in recs:
            line = lines.get(r.rid)
            if line is not None:
                r.engine, r.prefiller = line.get("engine", ""), line.get("prefiller", "")
        return recs

    def _grid_cell(self, mix: workload.Mix, frac: float, k: int) -> None:
        o = self.o
        rate = frac * self.capacity[mix.name]
        total = o.warmup + o.duration
        reqs = workload.poisson(
            mix, rate, total, o.seed + k + 17 * len(self.cells), self.b.model, self.wpt
        )
        cell = Cell(mix.name, rate, f"{frac:g}")
        for setup in self._order(len(self.cells)):
            recs = self._run(setup, reqs)
            self._keep(cell, setup, recs, o.warmup, total)
        self._done(cell)

    def _chat_cell(self) -> None:
        o = self.o
        cap = self.capacity.get(workload.MIXED.name) or next(iter(self.capacity.values()))
        turns = 4
        rate = 0.6 * cap / turns  # sessions per second: about 0.6 of capacity in turns
        total = o.warmup + o.duration
        chats = workload.sessions(rate, total, o.seed + 101, self.wpt, turns)
        cell = Cell("multi-turn chat", rate * turns, "")
        for setup in self._order(len(self.cells)):
            recs = self._run(setup, [], chats)
            self._keep(cell, setup, recs, o.warmup, total)
        self._done(cell)

    def _alternating_cell(self) -> None:
        o = self.o
        short, long = workload.SHORT, workload.LONG
        cap_s = self.capacity.get(short.name) or max(self.capacity.values())
        cap_l = self.capacity.get(long.name) or min(self.capacity.values())
        phase = max(5.0, o.duration / 2)
        plan = [(short, 0.6 * cap_s), (long, 0.6 * cap_l)] * 2
        reqs = workload.alternating(plan, phase, o.seed + 202, self.b.model, self.wpt)
        cell = Cell("alternating short/long", sum(r for _, r in plan) / len(plan), "")
        for setup in self._order(len(self.cells)):
            timeline: list[dict[str, Any]] = []
            if setup == "goodput":
                recs = self._with_timeline(setup, reqs, timeline)
                cell.timeline = timeline
            else:
                recs = self._run(setup, reqs)
            # the first phase warms up; each later phase is judged apart
            self._keep(cell, setup, recs, phase, phase * len(plan))
            for i in range(1, len(plan)):
                name = f"{i}:{plan[i][0].name}"
                cell.phases.setdefault(name, {})[setup] = slo.goodput(
                    self.slo, recs, i * phase, (i + 1) * phase
                )
        self._done(cell)

    def _with_timeline(
        self, setup: str, reqs: list[workload.Request], timeline: list[dict[str, Any]]
    ) -> list[Record]:
        """Run ``reqs`` while reading every engine's counters once a second."""
        import threading

        stop = threading.Event()
        b = self.b

        def poll() -> None:
            t0 = time.perf_counter()
            last = {u: b.counters(u) for u in b.engines}
            while not stop.wait(1.0):
                now = {u: b.counters(u) for u in b.engines}
                timeline.append(
                    {
                        "t": round(time.perf_counter() - t0, 2),
                        "prefill": {u: now[u][0] - last[u][0] for u in b.engines},
                        "decode": {u: now[u][1] - last[u][1] for u in b.engines},
                    }
                )
                last = now

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        try:
            return self._run(setup, reqs)
        finally:
            stop.set()
            th.join(5)

    def _keep(self, cell: Cell, setup: str, recs: list[Record], start: float, end: float) -> None:
        cell.goodput[setup] = slo.goodput(self.slo, recs, start, end)
        cell.stats[setup] = _summary(self.slo, recs, start, end)
        key = f"{cell.workload} @ {cell.rate:.2f}/s"
        self.records.setdefault(key, []).extend({"setup": setup, **r.summary()} for r in recs)

    def _done(self, cell: Cell) -> None:
        self.cells.append(cell)
        gp = ", ".join(f"{s} {cell.goodput[s]:.2f}" for s in SETUPS)
        r = cell.ratio()
        self.log(
            f"{self.b.name}: {cell.workload} @ {cell.rate:.2f} req/s: goodput {gp}; "
            f"new/best {r:.2f}"
            if r is not None
            else ""
        )

    # ------------------------------------------------------------------ result
    def result(self, seconds: float) -> dict[str, Any]:
        errs = [
            rec["predicted_ttft"] and abs(rec["ttft"] - rec["predicted_ttft"]) / rec["ttft"]
            for recs in self.records.values()
            for rec in recs
            if rec["setup"] == "goodput"
            and rec["ok"]
            and rec["ttft"]
            and rec["predicted_ttft"] is not None
        ]
        return {
            "backend": self.b.name,
            "describe": self.b.describe(),
            "seconds": round(seconds),
            "options": self.o.__dict__ | {"mixes": list(self.o.mixes)},
            "words_per_token": self.wpt,
            "interference": self.interference,
            "unloaded": self.unloaded.__dict__,
            "slo": self.slo.asdict(),
            "slo_text": self.slo.describe(),
            "slo_rule": slo.RULE,
            "capacity": self.capacity,
            "cells": [c.__dict__ for c in self.cells],
            "prediction_error_p50": statistics.median(errs) if errs else None,
            "predictions": len(errs),
            "records": self.records,
            "beliefs": self.beliefs,
        }


def in_gpu_time(result: dict[str, Any], slow_down: float) -> dict[str, Any]:
    """A result measured on engines ``slow_down`` times slower than the GPUs they stand for,
    in the GPUs' time: rates and goodput times it, latencies divided by it."""
    f = slow_down
    r = copy.deepcopy(result)
    r["capacity"] = {k: v * f for k, v in r["capacity"].items()}
    r["unloaded"] = {k: v / f for k, v in r["unloaded"].items()}
    r["slo"] = {k: v / f for k, v in r["slo"].items()}
    r["slo_text"] = Slo(**r["slo"]).describe()
    r["options"] = {
        **r["options"],
        "duration": r["options"]["duration"] / f,
        "warmup": r["options"]["warmup"] / f,
    }
    for c in r["cells"]:
        c["rate"] *= f
        c["goodput"] = {k: v * f for k, v in c["goodput"].items()}
        c["phases"] = {p: {k: v * f for k, v in gp.items()} for p, gp in c["phases"].items()}
        for t in c["timeline"]:
            t["t"] /= f
    for recs in r["records"].values():
        for rec in recs:
            for k in ("at", "ttft", "predicted_ttft", "itl_p95"):
                if rec.get(k) is not None:
                    rec[k] /= f
    r["time_scale"] = f
    return r
