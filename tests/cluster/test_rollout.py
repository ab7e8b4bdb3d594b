"""Upgrades that restart no engine needlessly, with the real controller-manager (issue 22): on a
running prod release, a chart-version-only upgrade, a router-only change (a value, its image) and an alert change
replace 0 engine pods (their UIDs unchanged), while a change of what the engines run (the model's
revision) replaces every one. A replaced GPU engine reloads its model: for the P5 profile, 70B of
weights on every node."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ci import lib
from tests import helm
from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane
from tests.cluster.releases import POD_SECURITY, by_component, layerings

ENV = "prod"
ENGINES = ("prefill", "decode")


@pytest.fixture
def ns(cluster: ControlPlane) -> Iterator[str]:
    name = "rollout"
    cluster.create_namespace(fleet.namespace(name, POD_SECURITY[ENV]))
    yield name
    cluster.run(helm.helm_binaries()[0], "uninstall", "pd", "-n", name)
    cluster.drop_namespace(name)


def bumped(tmp: Path) -> Path:
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


def engine_pods(cluster: ControlPlane, ns: str) -> dict[str, str]:
    """name -> UID of the engine pods that are not being deleted."""
    pods = by_component(cluster.get("pods", "-n", ns)["items"])
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for role in ENGINES
        for p in pods.get(role, [])
        if "deletionTimestamp" not in p["metadata"]
    }


def helm_to(cluster: ControlPlane, ns: str, verb: str, chart: Path, *extra: str) -> None:
    h4 = helm.helm_binaries()[0]
    values = lib.value_flags(layerings()[ENV])
    proc = cluster.run(h4, verb, "pd", chart, "-n", ns, *values, *extra, "--wait", "--timeout", "300s")
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.diagnose(ns)


def test_only_a_change_of_what_the_engines_run_replaces_engine_pods(
    cluster: ControlPlane, ns: str, tmp_path: Path
) -> None:
    helm_to(cluster, ns, "install", helm.CHART)
    before = engine_pods(cluster, ns)
    assert len(before) >= 2
    for what, chart, extra in (
        ("the chart's version alone", bumped(tmp_path), ()),
        ("a router value", helm.CHART, ("--set", "router.threshold=2048")),
        ("the router's image", helm.CHART, ("--set", "router.image.tag=9.9.9")),
        ("an alert threshold", helm.CHART, ("--set-json", "metrics.prometheusRule.thresholds.fallbackShare=0.3")),
    ):
        helm_to(cluster, ns, "upgrade", chart, *extra)
        for role in ENGINES:
            sts = cluster.get("statefulset", f"pd-pd-inference-{role}", "-n", ns)
            assert sts["status"]["updateRevision"] == sts["status"]["currentRevision"], what
        assert engine_pods(cluster, ns) == before, f"{what} replaced engine pods"
    helm_to(cluster, ns, "upgrade", helm.CHART, "--set", "model.revision=0123abcd")

    def all_replaced() -> bool:
        now = engine_pods(cluster, ns)
        return len(now) == len(before) and not set(now.values()) & set(before.values())

    cluster.wait_until("every engine pod replaced after the model's revision changed", all_replaced)
