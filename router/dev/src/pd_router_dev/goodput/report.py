"""The sweep's output: a markdown table (goodput per cell and configuration, the ratio of the
goodput decision to the better of the other two, the targets' tallies) and a heatmap picture
(goodput per cell per configuration, and the ratio)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pd_router_dev.goodput import slo

SETUPS = ("colocated", "split", "goodput")
TARGET_FLOOR = 0.95  # every cell: new >= 0.95 x the better of colocated and split
TARGET_WIN = 1.05  # at least a fifth of the cells: new >= 1.05 x
ALTERNATING_WITHIN = 0.05  # each phase within 5 % of the best static configuration


def _ratio(gp: dict[str, float]) -> float | None:
    best = max(gp.get("colocated", 0.0), gp.get("split", 0.0))
    new = gp.get("goodput")
    if new is None:
        return None
    if best <= 0:
        return 1.0 if new <= 0 else float("inf")
    return new / best


def _cell_name(c: dict[str, Any]) -> str:
    if c["fraction"]:
        return f"{c['workload']} @ {c['fraction']} x capacity ({c['rate']:.2f} req/s)"
    return f"{c['workload']} ({c['rate']:.2f} req/s)"


def table(result: dict[str, Any]) -> str:
    cells = result["cells"]
    lines = [
        f"### Goodput sweep: {result['backend']}",
        "",
        result["describe"],
        "",
        f"SLOs ({result.get('slo_rule', slo.RULE_BEFORE)}, measured at the start of the run: "
        "pd_router_dev/goodput/slo.py): "
        f"{result['slo_text']}. Colocated capacity (closed loop): "
        + ", ".join(f"{k} {v:.2f} req/s" for k, v in result["capacity"].items())
        + (
            f". An engine decoded {result['interference']:.2f} x slower while the others were "
            "busy too (the median gap of 8 streams on it alone, then with 8 streams on every "
            "engine)"
            if result.get("interference")
            else ""
        )
        + f". {result['options']['duration']:g} s of counted arrivals per cell "
        f"(+{result['options']['warmup']:g} s not counted); the whole run took "
        f"{result['seconds'] / 60:.0f} min.",
        "",
        "| cell | colocated | fixed split | goodput decision | new / best | TTFT misses (new) "
        "| ITL misses (new) | TTFT prediction error p50 | decisions (new) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for c in cells:
        gp = c["goodput"]
        r = _ratio(gp)
        if r is not None:
            ratios.append(r)
        st = c["stats"].get("goodput", {})
        err = st.get("prediction_error_p50")
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(st.get("reasons", {}).items()))
        lines.append(
            f"| {_cell_name(c)} | "
            + " | ".join(f"{gp.get(s, 0.0):.2f}" for s in SETUPS)
            + f" | **{r:.2f}** | {st.get('ttft_miss', '')} / {st.get('requests', '')}"
            f" | {st.get('itl_miss', '')} / {st.get('requests', '')}"
            f" | {'' if err is None else f'{err * 100:.0f} %'} | {reasons} |"
        )
    floor = sum(1 for r in ratios if r >= TARGET_FLOOR)
    wins = sum(1 for r in ratios if r >= TARGET_WIN)
    lines += [
        "",
        f"Cells with new / best >= {TARGET_FLOOR}: **{floor} of {len(ratios)}**; >= "
        f"{TARGET_WIN}: **{wins} of {len(ratios)}** (target: every cell, and a fifth). "
        f"TTFT prediction error, p50 over every request of the goodput decision: "
        + (
            f"**{result['prediction_error_p50'] * 100:.0f} %** ({result['predictions']} "
            "requests; target 25 %)."
            if result["prediction_error_p50"] is not None
            else "none measured."
        ),
    ]
    for c in cells:
        if not c["phases"]:
            continue
        lines += ["", "Alternating workload, goodput per phase (the first phase warms up):", ""]
        lines += [
            "| phase | colocated | fixed split | goodput decision | new / best static |",
            "|---|---|---|---|---|",
        ]
        for name, gp in c["phases"].items():
            lines.append(
                f"| {name} | "
                + " | ".join(f"{gp.get(s, 0.0):.2f}" for s in SETUPS)
                + f" | **{_ratio(gp):.2f}** |"
            )
        st = c["stats"].get("goodput", {})
        lines += [
            "",
            f"Goodput decision over the phases after the first: {st.get('failed', 0)} requests "
            f"failed, {st.get('fallbacks', 0)} prefilled twice (a hand-off abandoned and the "
            "prompt served again), of "
            f"{st.get('requests', 0)}.",
        ]
        if c["timeline"]:
            lines += [
                "",
                "Who prefilled while the mix alternated (goodput decision; each engine's share of "
                "the prompt tokens computed, from its own metrics):",
                "",
            ]
            lines.append("`" + timeline_text(c["timeline"]) + "`")
    return "\n".join(lines) + "\n"


def timeline_text(timeline: list[dict[str, Any]], every: int = 2) -> str:
    """Per ``every`` seconds, each engine's share of the prompt tokens computed (A 80 % ...)."""
    out = []
    engines = sorted(timeline[0]["prefill"]) if timeline else []
    names = {u: chr(ord("A") + i) for i, u in enumerate(engines)}
    for i in range(0, len(timeline), every):
        chunk = timeline[i : i + every]
        tot = {u: sum(t["prefill"][u] for t in chunk) for u in engines}
        s = sum(tot.values())
        share = " ".join(f"{names[u]}{(100 * tot[u] / s) if s else 0:.0f}" for u in engines)
        out.append(f"{chunk[-1]['t']:.0f}s:{share}")
    return " | ".join(out)


def heatmap(results: list[dict[str, Any]], path: Path) -> None:
    """One row of panels per backend: goodput of each configuration per cell, then the
    ratio new / best of the other two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(results), 4, figsize=(22, 5.2 * len(results)), squeeze=False)
    for row, res in zip(axes, results, strict=True):
        cells = res["cells"]
        grid = [c for c in cells if c["fraction"]]
        extras = [c for c in cells if not c["fraction"]]
        mixes = list(dict.fromkeys(c["workload"] for c in grid))
        # one column at least: a run of the extras alone (--cells chat) has no rate fractions
        fracs = list(dict.fromkeys(c["fraction"] for c in grid)) or [""]
        # rows: mixes then each extra workload (one column used); columns: rate fractions
        labels = mixes + [c["workload"] for c in extras]

        def matrix(
            value: Any,
            labels: list[str] = labels,
            fracs: list[str] = fracs,
            grid: list[Any] = grid,
            mixes: list[str] = mixes,
            extras: list[Any] = extras,
        ) -> np.ndarray:
            m = np.full((len(labels), len(fracs)), np.nan)
            for c in grid:
                m[mixes.index(c["workload"]), fracs.index(c["fraction"])] = value(c)
            for k, c in enumerate(extras):
                m[len(mixes) + k, len(fracs) // 2] = value(c)
            return m

        vmax = max(max(c["goodput"].values()) for c in cells)
        for ax, setup in zip(row[:3], SETUPS, strict=True):
            m = matrix(lambda c, s=setup: c["goodput"].get(s, 0.0))
            im = ax.imshow(m, cmap="viridis", vmin=0, vmax=vmax)
            _annotate(ax, m, "{:.2f}")
            ax.set_title(
                f"{res['backend']}: {setup.replace('goodput', 'goodput decision')}\n"
                "good requests / s"
            )
            _axes(ax, labels, fracs)
            fig.colorbar(im, ax=ax, fraction=0.046)
        m = matrix(lambda c: _ratio(c["goodput"]) or 0.0)
        im = row[3].imshow(m, cmap="RdYlGn", vmin=0.5, vmax=1.5)
        _annotate(row[3], m, "{:.2f}")
        row[3].set_title(f"{res['backend']}:\ngoodput decision / best of the other two")
        _axes(row[3], labels, fracs)
        fig.colorbar(im, ax=row[3], fraction=0.046)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _annotate(ax: Any, m: Any, fmt: str) -> None:
    import math

    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            v = m[i, j]
            if not math.isnan(v):
                ax.text(
                    j,
                    i,
                    fmt.format(v),
                    ha="center",
                    va="center",
                    color="black",
                    bbox={"facecolor": "white", "alpha": 0.6, "lw": 0},
                )


def _axes(ax: Any, labels: list[str], fracs: list[str]) -> None:
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xticks(range(len(fracs)), fracs)
    ax.set_xlabel("arrival rate / colocated capacity (extras: their own rate)")


def main(argv: list[str] | None = None) -> int:
    """``python -m pd_router_dev.goodput.report RESULT.json... [--picture PNG]``: the table
    (and the heatmap) of sweeps already run."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m pd_router_dev.goodput.report")
    p.add_argument("results", nargs="+", help="goodput-*.json written by a sweep")
    p.add_argument("--picture", default="", help="write the heatmap here (PNG)")
    a = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in a.results]
    print("\n".join(table(r) for r in results))
    if a.picture:
        heatmap(results, Path(a.picture))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
