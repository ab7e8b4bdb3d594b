"""The LeaderWorkerSet controller (kubernetes-sigs/lws, built by scripts/install-kube.sh, started
by ControlPlane.start_lws) on the test cluster, on each Kubernetes version: what a multi-node
engine relies on. A group of a leader and a worker lands on the fake P5 nodes under `restricted`
Pod Security; LWS's pod webhook gives each pod the group's labels and the leader's address; a
pod that goes takes its whole group with it (RecreateGroupOnPodRestart, the default)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane

NS = "lws-smoke"
NAME = "smoke"
LABEL = "leaderworkerset.sigs.k8s.io"


@pytest.fixture
def ns(cluster: ControlPlane) -> Iterator[str]:
    cluster.create_namespace(fleet.namespace(NS, "restricted"))
    yield NS
    cluster.drop_namespace(NS)


def leader_worker_set(name: str = NAME, replicas: int = 1, exclusive: str = "") -> dict[str, Any]:
    """Size 2, the worker started with its leader pod (not once it is Ready); each pod a whole P5
    node; `exclusive`: a node label for LWS's exclusive placement (one group per value)."""
    pod = {
        "spec": {
            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
            "tolerations": [{**fleet.GPU_TAINT, "operator": "Equal"}],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "engine",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {"nvidia.com/gpu": "8"}},
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        }
    }
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": name,
            "namespace": NS,
            **({"annotations": {f"{LABEL}/exclusive-topology": exclusive}} if exclusive else {}),
        },
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {"size": 2, "workerTemplate": pod},
        },
    }


def group(cluster: ControlPlane, name: str = NAME, count: int = 2) -> dict[str, dict[str, Any]] | None:
    """A LeaderWorkerSet's pods by name once all `count` exist, are bound to a node and Ready
    (kwok), and none is being deleted; else None."""
    pods = cluster.get("pods", "-n", NS, "-l", f"{LABEL}/name={name}")["items"]
    if len(pods) != count:
        return None
    for p in pods:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        if "deletionTimestamp" in p["metadata"] or not p["spec"].get("nodeName") or not ready:
            return None
    return {p["metadata"]["name"]: p for p in pods}


def env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env", [])}


def test_a_group_runs_on_p5_nodes_and_is_recreated_whole(cluster: ControlPlane, ns: str) -> None:
    cluster.apply([leader_worker_set()])
    pods = cluster.wait_until("the leader and the worker Ready on nodes", lambda: group(cluster))
    assert sorted(pods) == ["smoke-0", "smoke-0-1"], cluster.diagnose(ns)
    leader, worker = pods["smoke-0"], pods["smoke-0-1"]

    # What LWS made of it: the leader StatefulSet, the group's worker StatefulSet (owned by the
    # leader pod) and the headless Service the pods' DNS names are under.
    assert sorted(s["metadata"]["name"] for s in cluster.get("statefulsets", "-n", ns)["items"]) == [
        "smoke",
        "smoke-0",
    ]
    owner = cluster.get("statefulset", "smoke-0", "-n", ns)["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owner] == [("Pod", "smoke-0")]
    service = cluster.get("service", NAME, "-n", ns)
    assert service["spec"]["clusterIP"] == "None"
    assert leader["spec"]["subdomain"] == worker["spec"]["subdomain"] == NAME

    # The pod webhook's labels and environment.
    for pod, index in ((leader, "0"), (worker, "1")):
        labels = pod["metadata"]["labels"]
        assert labels[f"{LABEL}/name"] == NAME and labels[f"{LABEL}/group-index"] == "0", labels
        assert labels[f"{LABEL}/worker-index"] == index, labels
        assert env(pod) == {
            "LWS_LEADER_ADDRESS": f"smoke-0.{NAME}.{ns}",
            "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": index,
        }, env(pod)
    assert leader["metadata"]["labels"][f"{LABEL}/group-key"] == worker["metadata"]["labels"][f"{LABEL}/group-key"]

    # Each on a P5 node of its own (8 GPUs each).
    nodes = {p["spec"]["nodeName"] for p in pods.values()}
    assert len(nodes) == 2
    for node in nodes:
        assert cluster.get("node", node)["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"

    # A worker that goes takes its group with it: a new leader, and a new worker.
    before = {name: p["metadata"]["uid"] for name, p in pods.items()}
    cluster.delete_pod_held(
        ns, "smoke-0-1", "LWS deleting the leader", lambda: cluster.pod_going(ns, "smoke-0", before["smoke-0"])
    )

    def recreated() -> dict[str, dict[str, Any]] | None:
        now = group(cluster)
        if now and all(p["metadata"]["uid"] != before.get(name) for name, p in now.items()):
            return now
        return None

    # a longer hang guard than a start's: a new leader and a new worker are scheduled and made
    # Ready one after the other while the other pytest worker may be running real engines
    try:
        after = cluster.wait_until("the whole group recreated", recreated, deadline_s=300)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.diagnose(ns)}") from None
    assert sorted(after) == ["smoke-0", "smoke-0-1"], cluster.diagnose(ns)


def test_exclusive_topology_gives_each_group_a_zone_of_its_own(cluster: ControlPlane, ns: str) -> None:
    """The exclusive-topology annotation: each group's pods in one zone (the leader's, by pod
    affinity; the workers by a node selector on it), and no two groups in one zone. Without it a
    group's pods go wherever the scheduler puts them, different zones included."""
    cluster.apply([leader_worker_set("zonal", replicas=2, exclusive="topology.kubernetes.io/zone")])
    pods = cluster.wait_until("both groups Ready on nodes", lambda: group(cluster, "zonal", count=4))
    zone = {
        n["metadata"]["name"]: n["metadata"]["labels"]["topology.kubernetes.io/zone"]
        for n in cluster.get("nodes")["items"]
    }
    zones: dict[str, set[str]] = {}
    for p in pods.values():
        zones.setdefault(p["metadata"]["labels"][f"{LABEL}/group-index"], set()).add(zone[p["spec"]["nodeName"]])
    assert sorted(zones) == ["0", "1"] and all(len(z) == 1 for z in zones.values()), zones
    assert zones["0"] != zones["1"], zones
    worker = pods["zonal-0-1"]
    assert worker["spec"]["nodeSelector"]["topology.kubernetes.io/zone"] == zone[pods["zonal-0"]["spec"]["nodeName"]]


def test_lws_webhooks_meet_only_its_own_pods(cluster: ControlPlane) -> None:
    """The pod webhooks (failurePolicy Fail) select pods labelled with an LWS name only: no other
    pod of the cluster waits on the controller."""
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        config = cluster.get(kind, f"lws-{kind.replace('webhookconfiguration', '')}-webhook-configuration")
        pods = [h for h in config["webhooks"] if h["rules"][0]["resources"] == ["pods"]]
        assert len(pods) == 1, config["webhooks"]
        assert pods[0]["objectSelector"] == {"matchExpressions": [{"key": f"{LABEL}/name", "operator": "Exists"}]}
