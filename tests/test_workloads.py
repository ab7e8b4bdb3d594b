"""What matters in the engine and router pods: accelerators, EFA, security, placement, probes,
PDBs, autoscaling, checksums, images."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ci import lib
from tests import helm
from tests.cases import LMCACHE
from tests.manifests import container, pod_spec, router_config

ZONE = "topology.kubernetes.io/zone"
CHART_VERSION = yaml.safe_load((helm.CHART / "Chart.yaml").read_text())["version"]


@pytest.mark.parametrize("tp", [1, 8])
def test_gpus_equal_tensor_parallel_size(h4: Path, tp: int) -> None:
    docs = helm.render(h4, sets=(f"prefill.tensorParallelSize={tp}", f"decode.tensorParallelSize={tp}"))
    for role in ("prefill", "decode"):
        c = container(docs, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert c["resources"]["requests"]["nvidia.com/gpu"] == tp
        assert f"--tensor-parallel-size={tp}" in c["args"]


def test_efa_switch_adds_devices_hugepages_and_ipc_lock(h4: Path) -> None:
    off = helm.render(h4)
    on = helm.render(h4, sets=("efa.enabled=true", "efa.devices=32"))
    for role in ("prefill", "decode"):
        c_off, c_on = container(off, role), container(on, role)
        for kind in ("requests", "limits"):
            assert "vpc.amazonaws.com/efa" not in c_off["resources"][kind]
            assert "hugepages-2Mi" not in c_off["resources"][kind]
            assert c_on["resources"][kind]["vpc.amazonaws.com/efa"] == 32
            assert c_on["resources"][kind]["hugepages-2Mi"] == "5120Mi"
            # User resources survive the merge.
            assert "memory" in c_on["resources"][kind]
        assert "add" not in c_off["securityContext"]["capabilities"]
        assert c_on["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c_on["securityContext"]["privileged"] is False
        assert {"name": "FI_PROVIDER", "value": "efa"} in c_on["env"]


def test_privileged_is_a_separate_opt_in(h4: Path) -> None:
    docs = helm.render(h4, sets=("efa.enabled=true", "efa.privileged=true"))
    for role in ("prefill", "decode"):
        assert container(docs, role)["securityContext"]["privileged"] is True


@pytest.mark.parametrize("receiver", ["router", "prefillSidecar"])
@pytest.mark.parametrize(
    "kind,suffix", [("StatefulSet", "-prefill"), ("StatefulSet", "-decode"), ("Deployment", "-router")]
)
def test_pods_are_non_root_and_locked_down(h4: Path, kind: str, suffix: str, receiver: str) -> None:
    docs = helm.render(h4, (LMCACHE,), sets=(f"kvTransfer.lmcache.notificationReceiver={receiver}",))
    spec = pod_spec(docs, kind, suffix)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]


def test_same_zone_affinity_by_default(h4: Path) -> None:
    docs = helm.render(h4)
    prefill_selector = helm.one(docs, "StatefulSet", "-prefill")["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        terms = pod_spec(docs, "StatefulSet", f"-{role}")["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        # Both roles follow the prefillers' zone (decoders towards the other role).
        assert terms == [{"topologyKey": ZONE, "labelSelector": {"matchLabels": prefill_selector}}]


def test_pinned_zone_replaces_pod_affinity(h4: Path) -> None:
    docs = helm.render(h4, sets=("placement.zone=us-east-2b",))
    for role in ("prefill", "decode"):
        spec = pod_spec(docs, "StatefulSet", f"-{role}")
        assert spec["nodeSelector"][ZONE] == "us-east-2b"
        assert "affinity" not in spec


def test_user_affinity_is_merged_with_zone_affinity(h4: Path) -> None:
    values = (
        "decode:\n  affinity:\n    podAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n"
        "        - topologyKey: kubernetes.io/hostname\n          labelSelector: {matchLabels: {cache: warm}}\n"
    )
    terms = pod_spec(helm.render(h4, values_yaml=values), "StatefulSet", "-decode")["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert [t["topologyKey"] for t in terms] == ["kubernetes.io/hostname", ZONE]


@pytest.mark.parametrize("mode,when", [("required", "DoNotSchedule"), ("preferred", "ScheduleAnyway")])
def test_spread_across_nodes(h4: Path, mode: str, when: str) -> None:
    docs = helm.render(h4, sets=(f"decode.spreadAcrossNodes={mode}",))
    (constraint,) = pod_spec(docs, "StatefulSet", "-decode")["topologySpreadConstraints"]
    assert constraint["whenUnsatisfiable"] == when and constraint["topologyKey"] == "kubernetes.io/hostname"
    assert "topologySpreadConstraints" not in pod_spec(docs, "StatefulSet", "-prefill")


def test_instance_type_selector_and_gpu_toleration(h4: Path) -> None:
    docs = helm.render(h4, ("values/profiles/llama-3.3-70b-p5.yaml",))
    for role in ("prefill", "decode"):
        spec = pod_spec(docs, "StatefulSet", f"-{role}")
        assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_engine_pod_volumes_probes_and_secrets(h4: Path) -> None:
    docs = helm.render(h4, sets=("model.hfTokenSecret.name=hf", "prefill.shmSize=32Gi"))
    spec = pod_spec(docs, "StatefulSet", "-prefill")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    c = container(docs, "prefill")
    # The token is a mounted file, never an env var.
    assert {"name": "HF_TOKEN_PATH", "value": "/var/run/secrets/huggingface/token"} in c["env"]
    assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert volumes["hf-token"]["secret"] == {
        "secretName": "hf",
        "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}],
    }
    assert {"name": "hf-token", "mountPath": "/var/run/secrets/huggingface", "readOnly": True} in c["volumeMounts"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    # no pinned revision and no mirror unless asked for
    assert not [a for a in c["args"] if a.startswith("--revision")]
    assert "HF_ENDPOINT" not in {e["name"] for e in c["env"]}
    # Long enough to load a 70B model from a cold cache: at least 20 minutes.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1200


def test_engine_model_revision_and_hub_mirror(h4: Path) -> None:
    docs = helm.render(h4, sets=("model.revision=0123abc", "model.hubEndpoint=https://hub.internal"))
    for role in ("prefill", "decode"):
        c = container(docs, role)
        assert "--revision=0123abc" in c["args"]
        assert {"name": "HF_ENDPOINT", "value": "https://hub.internal"} in c["env"]


@pytest.mark.parametrize("cache", ["pvc", "hostPath", "emptyDir"])
def test_model_cache_choice(h4: Path, cache: str) -> None:
    docs = helm.render(h4, sets=(f"modelCache.type={cache}",))
    sts = helm.one(docs, "StatefulSet", "-decode")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    if cache == "pvc":
        assert "model-cache" not in volumes
        assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "model-cache"
    else:
        assert cache in volumes["model-cache"] and "volumeClaimTemplates" not in sts["spec"]


@pytest.mark.parametrize("replicas,expected", [(1, False), (2, True)])
def test_pdb_only_when_more_than_one_replica(h4: Path, replicas: int, expected: bool) -> None:
    docs = helm.render(
        h4,
        sets=(
            "kvTransfer.connector=nixl",
            f"router.replicas={replicas}",
            f"prefill.replicas={replicas}",
            f"decode.replicas={replicas}",
        ),
    )
    names = {d["metadata"]["name"] for d in helm.find(docs, "PodDisruptionBudget")}
    for component in ("router", "prefill", "decode"):
        assert (f"pd-pd-inference-{component}" in names) is expected


def test_pdb_follows_autoscaling_min_replicas(h4: Path) -> None:
    keda = "decode:\n  replicas: 1\n  autoscaling: {enabled: true, kind: keda, minReplicas: 2, maxReplicas: 4, kedaTriggers: [{type: cpu, metadata: {value: '50'}}]}\n"
    docs = helm.render(h4, values_yaml=keda)
    assert helm.one(docs, "PodDisruptionBudget", "-decode")
    assert "replicas" not in helm.one(docs, "StatefulSet", "-decode")["spec"]
    so = helm.one(docs, "ScaledObject", "-decode")
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "pd-pd-inference-decode",
    }


def test_hpa_for_an_engine_role(h4: Path) -> None:
    values = (
        "prefill:\n  autoscaling:\n    enabled: true\n    metrics:\n      - type: Pods\n        pods:\n"
        "          metric: {name: vllm_num_requests_waiting}\n          target: {type: AverageValue, averageValue: '4'}\n"
    )
    docs = helm.render(h4, values_yaml=values)
    hpa = helm.one(docs, "HorizontalPodAutoscaler", "-prefill")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"


@pytest.mark.parametrize(
    "change,changed",
    [
        ("router.threshold=2048", {"router"}),
        ("kvTransfer.lmcache.bufferSize=4294967296", {"prefill", "decode"}),
        ("ports.proxyNotification=7600", {"router", "prefill"}),
        ("kvTransfer.connector=nixl", {"router", "prefill", "decode"}),
        ("engine.preflight.enabled=false", {"prefill", "decode"}),
    ],
)
def test_checksum_changes_with_config(h4: Path, change: str, changed: set[str]) -> None:
    def checksums(docs: list[dict[str, Any]]) -> dict[str, str]:
        return {
            d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["metadata"]["annotations"][
                "checksum/config"
            ]
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
        }

    before, after = checksums(helm.render(h4, (LMCACHE,))), checksums(helm.render(h4, (LMCACHE,), sets=(change,)))
    assert {c for c in before if before[c] != after[c]} == changed


def test_images_by_tag_or_digest(h4: Path) -> None:
    digest = "sha256:" + "a" * 64
    docs = helm.render(h4)
    assert container(docs, "decode")["image"] == "lmcache/vllm-openai:v0.5.6"
    assert pod_spec(docs, "Deployment", "-router")["containers"][0]["image"] == "ghcr.io/pd-inference/pd-router:0.1.0"
    docs = helm.render(h4, sets=(f"engine.image.digest={digest}", f"router.image.digest={digest}"))
    assert container(docs, "decode")["image"] == f"lmcache/vllm-openai@{digest}"
    assert (
        pod_spec(docs, "Deployment", "-router")["containers"][0]["image"] == f"ghcr.io/pd-inference/pd-router@{digest}"
    )


def test_the_engine_pods_helpers_run_their_own_image(h4: Path) -> None:
    """The metrics proxy (and LMCache's notification sidecar) run engine.helperImage: the
    router's repository unless set, the chart's appVersion unless pinned; router.image's tag or
    digest never reaches an engine pod (a router release would restart every engine)."""
    digest = "sha256:" + "b" * 64

    def helper(*sets: str) -> str:
        spec = pod_spec(helm.render(h4, sets=sets), "StatefulSet", "-decode")
        return next(c["image"] for c in spec["containers"] if c["name"] == "metrics-proxy")

    assert helper() == "ghcr.io/pd-inference/pd-router:0.1.0"
    assert helper("router.image.tag=9.9.9", f"router.image.digest={digest}") == "ghcr.io/pd-inference/pd-router:0.1.0"
    assert helper("router.image.repository=reg.example/pd-router") == "reg.example/pd-router:0.1.0"
    assert helper(f"engine.helperImage.digest={digest}") == f"ghcr.io/pd-inference/pd-router@{digest}"
    assert helper("engine.helperImage.repository=reg.example/helpers", "engine.helperImage.tag=0.0.9") == (
        "reg.example/helpers:0.0.9"
    )


def test_prod_pins_the_model_revision_and_every_image_digest(h4: Path) -> None:
    """Prod as Argo CD layers it: every engine runs `--revision=<40-hex commit>`, the router's hub
    tokenizer follows that commit, and every container of every pod (engines, their sidecars,
    router, helm test) pulls `repository@sha256:<64 hex>`, so no two pods of one StatefulSet can
    serve different weights or bits after a re-pull."""
    files = tuple(lib.environments()["prod"]["valueFiles"])
    docs = helm.render(h4, files)
    commit = yaml.safe_load((helm.ROOT / "values" / "prod.yaml").read_text())["model"]["revision"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit), commit
    for role in ("prefill", "decode"):
        assert f"--revision={commit}" in container(docs, role)["args"]
    assert router_config(docs)["model"]["tokenizerHub"]["revision"] == commit
    pods = [
        (d["kind"], d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in docs
        if "template" in d.get("spec", {})
    ]
    pods += [(d["kind"], d["metadata"]["name"], d["spec"]) for d in docs if d["kind"] == "Pod"]
    assert {kind for kind, _, _ in pods} == {"StatefulSet", "Deployment", "Pod"}
    images = {
        (name, c["name"]): c["image"]
        for _, name, spec in pods
        for c in spec["containers"] + spec.get("initContainers", [])
    }
    assert len(images) >= 6  # vllm and metrics-proxy in both roles, the router, the helm test
    for name, image in images.items():
        assert re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", image), (name, image)
    assert container(docs, "decode")["image"].startswith("lmcache/vllm-openai@sha256:")
    assert pod_spec(docs, "Deployment", "-router")["containers"][0]["image"].startswith(
        "ghcr.io/pd-inference/pd-router@sha256:"
    )


def test_recommended_labels_and_immutable_selectors(h4: Path) -> None:
    for doc in helm.render(h4):
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "component", "version", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], key)
        assert labels["helm.sh/chart"] == f"pd-inference-{CHART_VERSION}"
        if doc["kind"] in ("Deployment", "StatefulSet"):
            selector = doc["spec"]["selector"]["matchLabels"]
            assert set(selector) == {
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/component",
            }


def test_lmcache_router_is_single_and_recreated(h4: Path) -> None:
    deploy = helm.one(helm.render(h4, (LMCACHE,)), "Deployment", "-router")
    # rollingUpdate explicitly null: a defaulted one would make the switch to Recreate invalid.
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate", "rollingUpdate": None}
    for scaled in (("kvTransfer.connector=nixl",), ("kvTransfer.lmcache.notificationReceiver=prefillSidecar",)):
        deploy = helm.one(helm.render(h4, (LMCACHE,), sets=(*scaled, "router.replicas=3")), "Deployment", "-router")
        assert deploy["spec"]["replicas"] == 3
        assert deploy["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
        }


def test_router_autoscaling_with_the_notification_sidecar(h4: Path) -> None:
    sets = ("kvTransfer.lmcache.notificationReceiver=prefillSidecar", "router.autoscaling.enabled=true")
    docs = helm.render(h4, (LMCACHE,), sets=sets)
    hpa = helm.one(docs, "HorizontalPodAutoscaler", "-router")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert "replicas" not in helm.one(docs, "Deployment", "-router")["spec"]
    assert helm.one(docs, "PodDisruptionBudget", "-router")  # minReplicas 2


CUSTOM_KINDS = {
    # kind: (its API as --api-versions names it, the value that turns it on, the field a refusal names)
    "ServiceMonitor": ("monitoring.coreos.com/v1/ServiceMonitor", ("metrics.serviceMonitor.enabled=true",), "metrics.serviceMonitor.enabled"),
    "PodMonitor": ("monitoring.coreos.com/v1/PodMonitor", ("metrics.podMonitor.enabled=true",), "metrics.podMonitor.enabled"),
    "PrometheusRule": (
        "monitoring.coreos.com/v1/PrometheusRule",
        ("metrics.prometheusRule.enabled=true", "metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true"),
        "metrics.prometheusRule.enabled",
    ),
    "ScaledObject": (
        "keda.sh/v1alpha1/ScaledObject",
        ("decode.autoscaling.enabled=true", "decode.autoscaling.kind=keda", "decode.autoscaling.targetWaitingPerReplica=4",
         "metrics.prometheusUrl=http://prometheus:9090", "metrics.podMonitor.enabled=true"),
        "decode.autoscaling.kind",
    ),
    "LeaderWorkerSet": (
        "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet",
        ("decode.nodes=2", "decode.tensorParallelSize=2"),
        "decode.nodes",
    ),
    "HTTPRoute": (
        "gateway.networking.k8s.io/v1/HTTPRoute",
        ("router.httpRoute.enabled=true", "router.httpRoute.parentRefs[0].name=gw"),
        "router.httpRoute.enabled",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", CUSTOM_KINDS)
def test_custom_resources_are_gated_alike(h4: Path, kind: str) -> None:
    """Every custom kind: off by default; on, rendered where Helm reports its API (or
    crds.assumeInstalled); on without the API, a refusal naming the value, never a silent drop."""
    api, sets, field = CUSTOM_KINDS[kind]
    only = ("--api-versions", api)
    assert not helm.find(helm.render(h4), kind)
    others = tuple(f"--api-versions={a}" for k, (a, _, _) in CUSTOM_KINDS.items() if k != kind)
    assert len(helm.find(helm.render(h4, sets=sets, extra=(*only, *others), capabilities=False), kind)) == 1
    refused = helm.template(h4, sets=sets, extra=others, capabilities=False)
    assert refused.returncode != 0 and field in refused.stderr and api in refused.stderr, refused.stderr
    forced = helm.render(h4, sets=(*sets, "crds.assumeInstalled=true"), capabilities=False)
    assert len(helm.find(forced, kind)) == 1


def test_helm_test_pod_sends_a_short_and_a_long_request(h4: Path) -> None:
    docs = helm.render(h4, sets=("router.threshold=300",))
    pod = helm.one(docs, "Pod", "-helm-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    script = c["args"][0]
    assert '"short"' in script and '"long"' in script and "x-pd-route" in script
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["THRESHOLD"] == "300"
    assert env["ROUTER_URL"] == f"http://pd-pd-inference-router.{helm.NAMESPACE}.svc.cluster.local:8000"


def test_engine_root_filesystem_can_be_made_writable(h4: Path) -> None:
    for role in ("prefill", "decode"):
        assert container(helm.render(h4), role)["securityContext"]["readOnlyRootFilesystem"] is True
        docs = helm.render(h4, sets=("engine.readOnlyRootFilesystem=false",))
        assert container(docs, role)["securityContext"]["readOnlyRootFilesystem"] is False


def test_preflight_runs_before_vllm_and_execs_it(h4: Path) -> None:
    docs = helm.render(h4, ("values/profiles/qwen3.5-9b-g6.yaml",))
    cm = helm.one(docs, "ConfigMap", "-engine-preflight")
    assert cm["data"]["preflight.py"] == (helm.CHART / "files" / "preflight.py").read_text()
    for role in ("prefill", "decode"):
        c = container(docs, role)
        cut = c["command"].index("--")
        assert c["command"][cut + 1 :] == ["vllm", "serve"]
        assert c["command"][:2] == ["python3", "/etc/pd-inference/preflight.py"]
        assert set(c["command"][2:cut]) == {
            "--connector=nixl",
            "--backend=LIBFABRIC",
            "--buffer-device=cpu",
            "--buffer-field=kvTransfer.nixl.bufferDevice",
            "--efa-devices=1",
            "--checked-vllm=0.31.0,0.33.0",
            "--timeout-seconds=120",
        }
        mount = next(m for m in c["volumeMounts"] if m["name"] == "preflight")
        assert mount == {"name": "preflight", "mountPath": "/etc/pd-inference", "readOnly": True}
        volume = next(v for v in pod_spec(docs, "StatefulSet", f"-{role}")["volumes"] if v["name"] == "preflight")
        assert volume["configMap"]["name"] == cm["metadata"]["name"]


def test_preflight_can_be_turned_off(h4: Path) -> None:
    docs = helm.render(h4, sets=("engine.preflight.enabled=false",))
    assert not helm.find(docs, "ConfigMap", "-engine-preflight")
    for role in ("prefill", "decode"):
        c = container(docs, role)
        assert c["command"] == ["vllm", "serve"]
        assert all(m["name"] != "preflight" for m in c["volumeMounts"])


def test_g6_profile_follows_the_reference_pair(h4: Path) -> None:
    """Two g6.8xlarge, NixlConnector over LIBFABRIC on the one EFA interface a G6 has, one zone."""
    docs = helm.render(h4, ("values/profiles/qwen3.5-9b-g6.yaml",))
    for role in ("prefill", "decode"):
        c = container(docs, role)
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 1
        assert json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])["kv_connector_extra_config"] == {
            "backends": ["LIBFABRIC"]
        }
        spec = pod_spec(docs, "StatefulSet", f"-{role}")
        assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "g6.8xlarge"
        terms = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert [t["topologyKey"] for t in terms] == [ZONE]
