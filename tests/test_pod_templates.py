"""Engine pods are replaced only when what the engines run changes (issue 22): a release that
bumps only the chart's version, changes only the router (its image included) or only an alert leaves both engine
StatefulSets' pod templates byte-identical (no GPU engine reloads its model for it), while a
model change replaces them. tests/cluster/test_rollout.py shows the same with the real
controller-manager."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import helm
from tests.cases import LAYERINGS

PROD = LAYERINGS["env:prod"]


def templates(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Each workload's pod template, as the text the API server compares."""
    out = {}
    for kind in ("StatefulSet", "Deployment"):
        for d in helm.find(docs, kind):
            out[f"{kind}/{d['metadata']['name']}"] = yaml.safe_dump(d["spec"]["template"], sort_keys=True)
    return out


def bumped_chart(tmp: Path) -> Path:
    chart = tmp / "pd-inference"
    shutil.copytree(helm.CHART, chart)
    meta = chart / "Chart.yaml"
    text, n = re.subn(
        r"^version: (\d+)\.(\d+)\.(\d+)$",
        lambda m: f"version: {m[1]}.{m[2]}.{int(m[3]) + 1}",
        meta.read_text(),
        count=1,
        flags=re.M,
    )
    assert n == 1
    meta.write_text(text)
    return chart


@pytest.fixture(scope="module")
def base(h4_module: Path) -> dict[str, str]:
    return templates(helm.render(h4_module, PROD))


@pytest.fixture(scope="module")
def h4_module() -> Path:
    return helm.helm_binaries()[0]


ENGINES = ("StatefulSet/pd-pd-inference-prefill", "StatefulSet/pd-pd-inference-decode")
ROUTER = "Deployment/pd-pd-inference-router"


def test_a_chart_version_bump_replaces_no_pod(h4_module: Path, base: dict[str, str], tmp_path: Path) -> None:
    docs = helm.render(h4_module, PROD, chart=bumped_chart(tmp_path))
    sts = helm.one(docs, "StatefulSet", "-decode")
    assert (
        sts["metadata"]["labels"]["helm.sh/chart"]
        != helm.one(helm.render(h4_module, PROD), "StatefulSet", "-decode")["metadata"]["labels"]["helm.sh/chart"]
    )
    assert templates(docs) == base
    assert set(ENGINES) | {ROUTER} <= set(base)


@pytest.mark.parametrize(
    "values",
    [
        "router: {threshold: 2048}",
        "router: {logLevel: debug}",
        "metrics: {prometheusRule: {thresholds: {fallbackShare: 0.3}}}",
        # a router release: the engines' helpers run engine.helperImage, pinned apart
        f"router: {{image: {{tag: 9.9.9, digest: 'sha256:{'f' * 64}'}}}}",
    ],
    ids=["router threshold", "router log level", "alert threshold", "router image"],
)
def test_a_router_or_alert_change_leaves_the_engine_pods_alone(
    h4_module: Path, base: dict[str, str], values: str
) -> None:
    changed = templates(helm.render(h4_module, PROD, values_yaml=values))
    assert {k: changed[k] for k in ENGINES} == {k: base[k] for k in ENGINES}


@pytest.mark.parametrize(
    "sets",
    # prod pins the engine image by digest, which wins over the tag: a new image is a new digest
    [
        ("model.revision=0123abcd",),
        ("engine.image.digest=sha256:" + "e" * 64,),
        ("engine.helperImage.digest=sha256:" + "e" * 64,),
        ("kvTransfer.nixl.loadFailurePolicy=recompute",),
    ],
    ids=["model revision", "engine image", "engine helpers' image", "KV hand-off"],
)
def test_what_the_engines_run_replaces_them(h4_module: Path, base: dict[str, str], sets: tuple[str, ...]) -> None:
    changed = templates(helm.render(h4_module, PROD, sets))
    assert all(changed[k] != base[k] for k in ENGINES)
