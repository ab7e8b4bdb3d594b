"""The multi-node profile (values/profiles/llama-3.1-405b-p5x2.yaml: each role a LeaderWorkerSet of
two-pod groups) installed with `helm install --wait` into the real API server, its groups made by
the real LeaderWorkerSet controller (ControlPlane.start_lws): leaders and workers on the fake P5
nodes of one zone, the role's Service selecting leaders only, a deleted worker restarting its
group; and the upgrade from the one-node layout as the README's "Multi-node engines" says."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ci import lib
from tests import helm
from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane
from tests.cluster.releases import POD_SECURITY

PROFILE = "values/profiles/llama-3.1-405b-p5x2.yaml"
ONE_NODE = "values/profiles/llama-3.3-70b-p5.yaml"
ROLES = ("prefill", "decode")
LWS = "leaderworkerset.sigs.k8s.io"
HELM = helm.helm_binaries()[0]


@pytest.fixture
def ns(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    name = "multi-node-" + request.node.name.split("_")[1]
    cluster.create_namespace(fleet.namespace(name, POD_SECURITY["prod"]))  # EFA and a hostPath cache: privileged
    yield name
    cluster.run(HELM, "uninstall", "pd", "-n", name)
    cluster.drop_namespace(name)


def helm_install(cluster: ControlPlane, ns: str, verb: str, *files: str) -> None:
    proc = cluster.run(HELM, verb, "pd", helm.CHART, "-n", ns, *lib.value_flags(files), "--wait", "--timeout", "300s")
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.diagnose(ns)


def groups_ready(cluster: ControlPlane, ns: str) -> dict[str, list[dict[str, Any]]] | None:
    """Each role's pods once both LeaderWorkerSets are Available and every pod of theirs is bound,
    Ready and not being deleted (Helm 3's --wait does not know LeaderWorkerSets); else None."""
    sets = cluster.get("leaderworkerset", "-n", ns)["items"]
    available = [
        any(c["type"] == "Available" and c["status"] == "True" for c in (s.get("status") or {}).get("conditions", []))
        for s in sets
    ]
    if len(sets) != 2 or not all(available):
        return None
    out: dict[str, list[dict[str, Any]]] = {}
    for role in ROLES:
        pods = cluster.get("pods", "-n", ns, "-l", f"app.kubernetes.io/component={role}")["items"]
        for p in pods:
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            if "deletionTimestamp" in p["metadata"] or not p["spec"].get("nodeName") or not ready:
                return None
        if len(pods) != 2:
            return None
        out[role] = sorted(pods, key=lambda p: p["metadata"]["labels"][f"{LWS}/worker-index"])
    return out


def endpoint_ips(cluster: ControlPlane, ns: str, service: str) -> set[str]:
    slices = cluster.get("endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}")["items"]
    return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}


def test_install_places_each_group_on_p5_nodes_of_one_zone(cluster: ControlPlane, ns: str) -> None:
    helm_install(cluster, ns, "install", PROFILE)
    pods = cluster.wait_until("both roles' groups Ready", lambda: groups_ready(cluster, ns))
    nodes = {n["metadata"]["name"]: n["metadata"]["labels"] for n in cluster.get("nodes")["items"]}
    zones = set()
    for role in ROLES:
        leader, worker = pods[role]
        assert leader["metadata"]["name"] == f"pd-pd-inference-{role}-lws-0"
        assert worker["metadata"]["name"] == f"pd-pd-inference-{role}-lws-0-1"
        assert (
            leader["metadata"]["labels"][f"{LWS}/worker-index"],
            worker["metadata"]["labels"][f"{LWS}/worker-index"],
        ) == ("0", "1")
        for p in (leader, worker):
            labels = nodes[p["spec"]["nodeName"]]
            assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge"
            zones.add(labels["topology.kubernetes.io/zone"])
            vllm = p["spec"]["containers"][0]
            assert vllm["resources"]["requests"]["vpc.amazonaws.com/efa"] == "32"
            # LWS's webhook gave the worker its rank and both the leader's address, which the
            # chart's $(VAR)s in the command line read
            env = {e["name"]: e.get("value") for e in vllm["env"]}
            assert env["LWS_LEADER_ADDRESS"] == f"pd-pd-inference-{role}-lws-0.pd-pd-inference-{role}-lws.{ns}"
        assert {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}["LWS_WORKER_INDEX"] == "1"
        assert leader["spec"]["nodeName"] != worker["spec"]["nodeName"]  # 8 GPUs each: a node apiece
        # The router discovers the role through its Service: the leader only, whose API serves.
        assert endpoint_ips(cluster, ns, f"pd-pd-inference-{role}") == {leader["status"]["podIP"]}
    assert len(zones) == 1, zones
    # No chart StatefulSet: each role is its LeaderWorkerSet's (leader <lws>, workers <lws>-0).
    names = {s["metadata"]["name"] for s in cluster.get("statefulsets", "-n", ns)["items"]}
    assert names == {f"pd-pd-inference-{r}-lws{suffix}" for r in ROLES for suffix in ("", "-0")}, names


def test_deleting_a_worker_restarts_its_group(cluster: ControlPlane, ns: str) -> None:
    helm_install(cluster, ns, "install", PROFILE)
    before = cluster.wait_until("both roles' groups Ready", lambda: groups_ready(cluster, ns))
    leader, worker = before["decode"]
    cluster.delete_pod_held(
        ns,
        worker["metadata"]["name"],
        "LWS deleting the decode leader",
        lambda: cluster.pod_going(ns, leader["metadata"]["name"], leader["metadata"]["uid"]),
    )

    def restarted() -> dict[str, list[dict[str, Any]]] | None:
        now = groups_ready(cluster, ns)
        return now if now and now["decode"][0]["metadata"]["uid"] != leader["metadata"]["uid"] else None

    try:
        after = cluster.wait_until("the decode group recreated, leader and all", restarted)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.diagnose(ns)}") from None
    assert after["decode"][1]["metadata"]["uid"] != worker["metadata"]["uid"]
    # The other role's group was left alone.
    assert [p["metadata"]["uid"] for p in after["prefill"]] == [p["metadata"]["uid"] for p in before["prefill"]]


def test_upgrade_from_the_one_node_layout_replaces_statefulsets_by_groups(cluster: ControlPlane, ns: str) -> None:
    """A StatefulSet cannot become a LeaderWorkerSet in place: the upgrade deletes the role's
    StatefulSet and creates its LeaderWorkerSet (another name), whose groups take over the Service."""
    helm_install(cluster, ns, "install", ONE_NODE)
    assert {s["metadata"]["name"] for s in cluster.get("statefulsets", "-n", ns)["items"]} == {
        f"pd-pd-inference-{r}" for r in ROLES
    }
    helm_install(cluster, ns, "upgrade", PROFILE)
    pods = cluster.wait_until("both roles' groups Ready after the upgrade", lambda: groups_ready(cluster, ns))
    names = {s["metadata"]["name"] for s in cluster.get("statefulsets", "-n", ns)["items"]}
    assert not {f"pd-pd-inference-{r}" for r in ROLES} & names, names
    for role in ROLES:
        assert endpoint_ips(cluster, ns, f"pd-pd-inference-{role}") == {pods[role][0]["status"]["podIP"]}
