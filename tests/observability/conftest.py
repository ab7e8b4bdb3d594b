"""Fixtures of the observability tier: the environments it proves, each rendered by the chart and
run as a live stack scraped by a real Prometheus (tests/observability/livestack.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import helm
from tests.cases import LMCACHE
from tests.cluster import rendered
from tests.observability import prom
from tests.observability.livestack import LiveStack, live_stack

# The LMCache layering with every observability object on, and one role autoscaled by each kind.
LMCACHE_OBSERVED = """
metrics:
  prometheusUrl: http://prometheus-operated.monitoring.svc:9090
  serviceMonitor: {enabled: true}
  podMonitor: {enabled: true}
  prometheusRule: {enabled: true}
  grafanaDashboard: {enabled: true}
prefill:
  autoscaling: {enabled: true, kind: hpa, targetWaitingPerReplica: 4}
decode:
  autoscaling: {enabled: true, kind: keda, targetWaitingPerReplica: 8}
"""
STACKS = ("prod", "lmcache")


def render(name: str) -> list[dict[str, Any]]:
    if name == "prod":  # as its Argo CD Application renders it
        return list(rendered.environment("prod"))
    return helm.render(helm.helm_binaries()[0], (LMCACHE,), values_yaml=LMCACHE_OBSERVED)


def rule_file(docs: list[dict[str, Any]], path: Path) -> Path:
    """The PrometheusRule's groups as the rule file the Prometheus Operator mounts."""
    path.write_text(yaml.safe_dump({"groups": helm.one(docs, "PrometheusRule")["spec"]["groups"]}, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def stacks() -> Iterator[dict[str, LiveStack]]:
    prom.require_tools()
    out: dict[str, LiveStack] = {}
    with tempfile.TemporaryDirectory(prefix="pd-obs-") as tmp:
        managers = []
        try:
            for name in STACKS:
                work = Path(tmp) / name
                work.mkdir()
                docs = render(name)
                cm = live_stack(name, docs, work, [rule_file(docs, work / "rules.yaml")])
                out[name] = cm.__enter__()
                managers.append(cm)
            yield out
        finally:
            for cm in reversed(managers):
                cm.__exit__(None, None, None)


@pytest.fixture(params=STACKS)
def live(request: pytest.FixtureRequest, stacks: dict[str, LiveStack]) -> LiveStack:
    return stacks[request.param]
