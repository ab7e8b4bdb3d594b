"""Multi-node engines (<role>.nodes > 1): each engine a LeaderWorkerSet group, as the chart
renders it. The real LWS controller runs these in tests/cluster/test_multi_node_install.py; vLLM's
parser reads the command lines in tests/engines/test_engine_vllm_cli.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import helm
from tests.cases import LAYERINGS

PROFILE = "values/profiles/llama-3.1-405b-p5x2.yaml"
ROLES = ("prefill", "decode")
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def group(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return helm.one(docs, "LeaderWorkerSet", f"-{role}-lws")


def vllm(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return helm.render(helm.helm_binaries()[0], (PROFILE,))


def test_each_role_of_the_profile_is_one_leaderworkerset_and_no_statefulset(docs: list[dict[str, Any]]) -> None:
    assert not helm.find(docs, "StatefulSet")
    for role in ROLES:
        lws = group(docs, role)
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = lws["spec"]
        assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
        assert spec["leaderWorkerTemplate"]["size"] == 2
        assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


@pytest.mark.parametrize("role", ROLES)
def test_leader_serves_and_worker_runs_headless(docs: list[dict[str, Any]], role: str) -> None:
    lwt = group(docs, role)["spec"]["leaderWorkerTemplate"]
    leader, worker = vllm(lwt["leaderTemplate"]), vllm(lwt["workerTemplate"])
    common = ["--nnodes=2", "--master-addr=$(LWS_LEADER_ADDRESS)", "--tensor-parallel-size=16"]
    for flag in common:
        assert flag in leader["args"] and flag in worker["args"], flag
    assert "--node-rank=0" in leader["args"] and "--headless" not in leader["args"]
    assert "--node-rank=$(LWS_WORKER_INDEX)" in worker["args"] and "--headless" in worker["args"]
    # the leader is probed and drained like a one-node engine; the worker serves nothing to probe
    assert {"startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports"} & set(worker)
    assert len(lwt["workerTemplate"]["spec"]["containers"]) == 1  # no metrics proxy, no sidecar
    for c in (leader, worker):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["VLLM_HOST_IP"] == "$(POD_IP)"
        assert list(env).index("POD_IP") < list(env).index("VLLM_HOST_IP")  # expanded in order
        for kind in ("requests", "limits"):  # half the engine's 16 GPUs, and EFA on every pod
            assert c["resources"][kind]["nvidia.com/gpu"] == 8
            assert c["resources"][kind]["vpc.amazonaws.com/efa"] == 32
    for t in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        assert t["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        assert (
            t["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
            == "topology.kubernetes.io/zone"
        )


@pytest.mark.parametrize("role", ROLES)
def test_the_routers_service_selects_leaders_only(docs: list[dict[str, Any]], role: str) -> None:
    svc = helm.one(docs, "Service", f"-{role}")
    assert svc["spec"]["selector"][WORKER_INDEX] == "0"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    # not the LeaderWorkerSet's own name: LWS makes that headless Service, not-ready pods included
    assert svc["metadata"]["name"] != group(docs, role)["metadata"]["name"]


@pytest.mark.parametrize("role", ROLES)
def test_the_groups_pods_may_reach_each_other(docs: list[dict[str, Any]], role: str) -> None:
    policy = helm.one(docs, "NetworkPolicy", f"-{role}")
    own = {f"app.kubernetes.io/{k}": v for k, v in (("component", role), ("instance", "pd"), ("name", "pd-inference"))}
    rules = [r for r in policy["spec"]["ingress"] if r.get("from") == [{"podSelector": {"matchLabels": own}}]]
    assert rules and rules[0]["ports"] == [{"protocol": "TCP", "port": 1, "endPort": 65535}]


def test_one_node_layerings_render_no_multi_node_part() -> None:
    """One node per role keeps today's StatefulSets: no LeaderWorkerSet, no multi-node flag or
    variable, the Service selecting every pod of the role (the snapshot holds the default bytes)."""
    for name, files in LAYERINGS.items():
        if PROFILE in files:
            continue
        text = helm.template(helm.helm_binaries()[0], files).stdout
        assert "LeaderWorkerSet" not in text and "--nnodes" not in text and "VLLM_HOST_IP" not in text, name
        assert WORKER_INDEX not in text, name


def test_autoscaling_pdb_and_model_cache_claims_follow_the_group(h4: Path) -> None:
    sets = (
        "decode.autoscaling.enabled=true",
        "decode.autoscaling.targetWaitingPerReplica=4",
        "decode.autoscaling.minReplicas=2",
        "metrics.podMonitor.enabled=true",
        "modelCache.type=pvc",
        "prefill.groupTopologyKey=topology.k8s.aws/network-node-layer-3",
    )
    docs = helm.render(h4, (PROFILE,), sets)
    hpa = helm.one(docs, "HorizontalPodAutoscaler", "-decode")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "pd-pd-inference-decode-lws",
    }
    assert "replicas" not in group(docs, "decode")["spec"]
    assert helm.one(docs, "PodDisruptionBudget", "-decode")["spec"]["maxUnavailable"] == 1
    lwt = group(docs, "prefill")["spec"]["leaderWorkerTemplate"]
    assert [c["metadata"]["name"] for c in lwt["volumeClaimTemplates"]] == ["model-cache"]
    assert lwt["persistentVolumeClaimRetentionPolicy"]
    annotations = group(docs, "prefill")["metadata"]["annotations"]
    assert annotations["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "topology.k8s.aws/network-node-layer-3"


def test_data_parallel_side_channels_are_open_to_the_other_role(h4: Path) -> None:
    """Data-parallel rank i's NIXL side channel is ports.nixlSideChannel + i on its pod (vLLM
    0.31.0 / 0.33.0 nixl/base_scheduler.py): the other role may reach the whole range."""
    sets = ("decode.dataParallelSize=16", "decode.tensorParallelSize=1", "engine.kvEvents.enabled=false")
    docs = helm.render(h4, (PROFILE,), sets)
    ports = [p for r in helm.one(docs, "NetworkPolicy", "-decode")["spec"]["ingress"] for p in r.get("ports", [])]
    assert {"protocol": "TCP", "port": 5601, "endPort": 5615} in ports
    args = vllm(group(docs, "decode")["spec"]["leaderWorkerTemplate"]["workerTemplate"])["args"]
    assert "--data-parallel-size=16" in args


def test_without_the_leaderworkerset_api_the_render_stops_naming_the_value(h4: Path) -> None:
    result = helm.template(h4, (PROFILE,), capabilities=False)
    assert result.returncode != 0 and "prefill.nodes" in result.stderr
    assert "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet" in result.stderr
