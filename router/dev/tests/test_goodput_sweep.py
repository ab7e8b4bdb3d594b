"""The goodput sweep's plumbing end to end on two simulated engines (one cell, seconds long):
what ``make goodput`` runs on real engines after the same calibration, capacity and
interference steps, so that the documented command cannot rot while nothing runs it. The
figures themselves are not asserted (speed goes in ``make goodput``)."""

from __future__ import annotations

from pathlib import Path

from pd_router_dev.devstack import Stack
from pd_router_dev.goodput import report, sweep
from pd_router_dev.goodput.sim import SimBackend


def test_one_cell_runs_every_configuration_and_reports(tmp_path: Path) -> None:
    opts = sweep.Options(
        duration=3.0,
        warmup=0.5,
        capacity_seconds=2.0,
        clients_per_engine=4,
        mixes=("mixed-20%-long",),
        cells=("grid",),
        fractions=(0.5,),
    )
    (tmp_path / "stack").mkdir()
    with Stack(tmp_path / "stack") as stack:
        result = sweep.Sweep(SimBackend(stack, 2, 2.0), opts, tmp_path, log=lambda s: None).run()
    (cell,) = result["cells"]
    assert set(cell["goodput"]) == set(sweep.SETUPS)
    seen = {r["setup"] for recs in result["records"].values() for r in recs}
    assert seen == set(sweep.SETUPS)
    every = [r for recs in result["records"].values() for r in recs]
    assert every and all(r["ok"] for r in every), [r["error"] for r in every if not r["ok"]][:3]
    # the goodput decision's requests carry its reasons and predictions
    mine = [r for r in every if r["setup"] == "goodput"]
    assert {r["reason"] for r in mine} <= {
        "handoff_not_worth",
        "whole_best",
        "one_engine_enough",
        "split_protects_itl",
        "split_faster",
    }
    assert any(r["predicted_ttft"] for r in mine)
    md = report.table(result)
    assert "| cell |" in md and "goodput decision" in md
    report.heatmap([result], tmp_path / "goodput.png")
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_heatmap_of_a_run_without_the_grid(tmp_path: Path) -> None:
    """``--cells chat``: no rate fractions, one column (it raised IndexError with none)."""
    cell = {
        "workload": "multi-turn chat",
        "rate": 3.0,
        "fraction": "",
        "goodput": {"colocated": 2.0, "split": 2.2, "goodput": 2.1},
    }
    report.heatmap([{"backend": "test", "cells": [cell]}], tmp_path / "chat.png")
    assert (tmp_path / "chat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
