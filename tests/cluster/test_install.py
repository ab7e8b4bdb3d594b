"""Every environment, with Helm 4 and Helm 3, installed into the real API server: admitted by Pod
Security at the level docs/operating.md states, scheduled onto the fake GPU fleet with every engine in
one zone while the other zone had room, Ready, and its `helm test` pod created and scheduled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ci import lib
from tests import helm
from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane
from tests.cluster.releases import POD_SECURITY, by_component, layerings, names

LAYERINGS = layerings()
ENGINES = ("prefill", "decode")


@pytest.fixture
def release(cluster: ControlPlane, request: pytest.FixtureRequest, helm_bin: Path) -> Iterator[str]:
    """A namespace for the test's release, uninstalled and deleted afterwards (the fleet is shared)."""
    env = request.node.callspec.params["env"]
    ns = f"{env}-{names(helm_bin)}"
    cluster.create_namespace(fleet.namespace(ns, POD_SECURITY[env]))
    yield ns
    # No `--wait`: Helm 4.2.1 then waits out the whole timeout (helm/helm#32214); dropping the
    # namespace removes its pods at once instead.
    cluster.run(helm_bin, "uninstall", "pd", "-n", ns)
    cluster.drop_namespace(ns)


def install(cluster: ControlPlane, helm_bin: Path, env: str, ns: str, *extra: str) -> None:
    values = lib.value_flags(LAYERINGS[env])
    proc = cluster.run(helm_bin, "install", "pd", helm.CHART, "-n", ns, *values, "--wait", "--timeout", "300s", *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.diagnose(ns)


@pytest.mark.parametrize("env", sorted(LAYERINGS))
def test_installs_in_one_zone_ready_and_its_helm_test_runs(
    cluster: ControlPlane, helm_bin: Path, env: str, release: str
) -> None:
    install(cluster, helm_bin, env, release)
    nodes = {n["metadata"]["name"]: n for n in cluster.get("nodes")["items"]}
    pods = by_component(cluster.get("pods", "-n", release)["items"])
    assert set(pods) >= {"router", "prefill", "decode"}, sorted(pods)
    for component, members in pods.items():
        for p in members:
            ready = {c["type"]: c["status"] for c in p["status"]["conditions"]}
            assert p["status"]["phase"] == "Running" and ready["Ready"] == "True", (component, p["metadata"]["name"])
    engines = [p for c in ENGINES for p in pods[c]]
    zone_of = {name: n["metadata"]["labels"]["topology.kubernetes.io/zone"] for name, n in nodes.items()}
    zones = {zone_of[p["spec"]["nodeName"]] for p in engines}
    assert len(zones) == 1, f"engines spread over {zones}"
    # ... although the other zone had room for all of them: the chart's affinity chose one zone.
    itype = {nodes[p["spec"]["nodeName"]]["metadata"]["labels"]["node.kubernetes.io/instance-type"] for p in engines}
    other = [
        n
        for n, z in zone_of.items()
        if z not in zones and nodes[n]["metadata"]["labels"]["node.kubernetes.io/instance-type"] in itype
    ]
    assert len(other) >= len(engines)
    # The routers need no GPU node.
    for p in pods["router"]:
        assert "nvidia.com/gpu" not in nodes[p["spec"]["nodeName"]]["status"]["capacity"], p["spec"]["nodeName"]
    # No node holds more GPUs' worth of engines than it has: placed by GPU, EFA and huge-page requests.
    for n in {p["spec"]["nodeName"] for p in engines}:
        asked = sum(
            int(p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"])
            for p in engines
            if p["spec"]["nodeName"] == n
        )
        assert asked <= int(nodes[n]["status"]["capacity"]["nvidia.com/gpu"]), n
    check_helm_test_pod(cluster, helm_bin, release)


def check_helm_test_pod(cluster: ControlPlane, helm_bin: Path, ns: str) -> None:
    """`helm test`: its pod is created and scheduled onto a CPU node."""
    # Helm 4.2.1 waits out --timeout on each hook deletion (before-hook-creation, hook-succeeded)
    # although the pod is gone at once (helm/helm#32214, fixed in 4.2.2): keep it short.
    proc = cluster.run(helm_bin, "test", "pd", "-n", ns, "--timeout", "10s")
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.diagnose(ns)
    # kwok plays the pod's run (it Succeeds, then hook-succeeded deletes it); the scheduler placed
    # it on a CPU node: its Scheduled event stays.
    events = cluster.get("events", "-n", ns, "--field-selector", "reason=Scheduled")["items"]
    (scheduled,) = [e for e in events if e["involvedObject"]["name"].endswith("-helm-test")]
    node = scheduled["message"].rsplit(" to ", 1)[1]
    assert "nvidia.com/gpu" not in cluster.get("node", node)["status"]["capacity"]
