"""What admission (Pod Security) and strict server-side field validation make of every
environment's objects, on the real API server."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ci import crd_schema, lib
from tests import helm
from tests.cluster import fleet, rendered
from tests.cluster.controlplane import ControlPlane
from tests.cluster.releases import POD_SECURITY

ENV_FILES = {name: env["valueFiles"] for name, env in lib.environments().items()}
ENVS = sorted(ENV_FILES)


@pytest.fixture
def pss_namespaces(cluster: ControlPlane) -> dict[str, str]:
    names = {level: f"pss-{level}" for level in rendered.LEVELS}
    cluster.apply([fleet.namespace(ns, level) for level, ns in names.items()])
    return names


def admitted(cluster: ControlPlane, pod: dict[str, Any]) -> tuple[bool, str]:
    proc = cluster.apply([pod], "--dry-run=server", check=False)
    return proc.returncode == 0, proc.stderr.strip()


@pytest.mark.parametrize("env", ENVS)
def test_pod_security_level_each_pod_needs(cluster: ControlPlane, pss_namespaces: dict[str, str], env: str) -> None:
    """The router (and the helm test pod) pass `restricted`; each engine needs exactly the level
    docs/operating.md states: admitted there, refused one level stricter (with the reason)."""
    needs: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for doc in rendered.environment(env):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        for level in rendered.LEVELS:
            ok, why = admitted(cluster, rendered.pod_of(doc, pss_namespaces[level]))
            if ok:
                needs[component] = level
                break
            reasons[component] = why
    assert needs == {"router": "restricted", "prefill": POD_SECURITY[env], "decode": POD_SECURITY[env]}, reasons
    # The helm test pod (Argo CD skips test hooks, so it is rendered here directly) too.
    (test_pod,) = [d for d in helm.render(helm.helm_binaries()[0], tuple(ENV_FILES[env])) if d["kind"] == "Pod"]
    test_pod["metadata"]["namespace"] = pss_namespaces["restricted"]
    test_pod["spec"].pop("serviceAccountName", None)
    ok, why = admitted(cluster, test_pod)
    assert ok, why
    if POD_SECURITY[env] == "privileged":
        # Refused at baseline for what EFA needs: adding IPC_LOCK (and prod's hostPath cache).
        assert "IPC_LOCK" in reasons["decode"], reasons["decode"]


@pytest.mark.parametrize("env", ENVS)
def test_custom_resources_pass_strict_server_side_validation(cluster: ControlPlane, env: str) -> None:
    """ServiceMonitor, PodMonitor, PrometheusRule and ScaledObject, as each environment renders
    them, against the operators' CRDs in the API server with --validate=strict; and the offline
    check ci/render.py runs (ci/crd_schema.py) agrees."""
    custom = [d for d in rendered.environment(env) if crd_schema.is_custom_resource(d)]
    if env == "dev":
        assert custom == []  # dev renders no monitor and no autoscaler
        return
    if env == "prod":  # every custom kind the chart has
        assert {d["kind"] for d in custom} == {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}
    ns = f"crs-{env}"
    cluster.apply([fleet.namespace(ns, "restricted")])
    for doc in custom:
        doc = {**doc, "metadata": {**doc["metadata"], "namespace": ns}}
        proc = cluster.apply([doc], "--dry-run=server", check=False)
        assert proc.returncode == 0, proc.stderr
        assert crd_schema.validate(doc) == []
        # The negative control: a field the CRD does not declare is refused, by both.
        bad = copy.deepcopy(doc)
        bad["spec"]["notAFieldOfThisKind"] = True
        proc = cluster.apply([bad], "--dry-run=server", check=False)
        assert proc.returncode != 0 and "notAFieldOfThisKind" in proc.stderr, proc.stderr
        assert any("notAFieldOfThisKind" in e for e in crd_schema.validate(bad))
