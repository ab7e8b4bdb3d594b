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


# --- the operator knobs (issue 22): tests/values/operator-knobs.yaml ------------------------------

KNOBS = "scenario:operator-knobs"
PRIORITIES = {"pd-inference-engine": 100000, "pd-inference-router": 50000}
# A RuntimeClass with an overhead: admission copying it into the pod proves the class was resolved.
OVERHEAD = {"cpu": "250m", "memory": "128Mi"}
RUNTIMES = {"nvidia": OVERHEAD, "runc": None}


@pytest.fixture
def knob_classes(cluster: ControlPlane) -> Any:
    """The PriorityClasses and RuntimeClasses tests/values/operator-knobs.yaml names (cluster-wide;
    removed afterwards)."""
    objs: list[dict[str, Any]] = [
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": n}, "value": v}
        for n, v in PRIORITIES.items()
    ]
    for name, overhead in RUNTIMES.items():
        rc: dict[str, Any] = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name}}
        rc["handler"] = name
        if overhead:
            rc["overhead"] = {"podFixed": overhead}
        objs.append(rc)
    cluster.apply(objs)
    yield
    cluster.kubectl(
        "delete",
        *[f"priorityclass/{n}" for n in PRIORITIES],
        *[f"runtimeclass/{n}" for n in RUNTIMES],
        "--ignore-not-found",
    )


def _served(cluster: ControlPlane, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects as the API server would store them (server-side dry run, strict validation)."""
    import json

    proc = cluster.apply(docs, "--dry-run=server", "-o", "json", check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    return out["items"] if out.get("kind") == "List" else [out]


def test_operator_knobs_pass_strict_server_side_validation_and_admission(
    cluster: ControlPlane, knob_classes: None
) -> None:
    """Every object of the all-knobs values file, as the API server keeps it (nothing dropped as
    an unknown or feature-gated field), and its pods as admission makes them: priority from the
    PriorityClass, the RuntimeClass's overhead, the preStop wait and grace period."""
    from tests import cases

    ns = "operator-knobs"
    cluster.apply([fleet.namespace(ns, POD_SECURITY["defaults"])])
    docs = helm.render(helm.helm_binaries()[0], cases.LAYERINGS[KNOBS], namespace=ns)
    served = {f"{d['kind']}/{d['metadata']['name'].split('-')[-1]}": d for d in _served(cluster, docs)}
    sts = served["StatefulSet/decode"]["spec"]
    assert sts["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Delete"}
    so = served["ScaledObject/decode"]["spec"]
    assert (so["pollingInterval"], so["cooldownPeriod"]) == (15, 600)
    assert so["fallback"] == {"failureThreshold": 5, "replicas": 4, "behavior": "currentReplicasIfHigher"}
    assert so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["selectPolicy"] == "Min"
    for component, window in (("prefill", 600), ("router", 120)):
        behavior = served[f"HorizontalPodAutoscaler/{component}"]["spec"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == window, behavior
    want = {  # component: (priority class, runtime class, grace, preStop seconds)
        "router": ("pd-inference-router", "runc", 30, None),
        "prefill": ("pd-inference-engine", "nvidia", 60, 15),  # discoveryRefreshSeconds 5 + dnsCacheSeconds 10
        "decode": ("pd-inference-engine", "nvidia", 330, 15),
    }
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        (pod,) = _served(cluster, [rendered.pod_of(doc, ns)])
        spec = pod["spec"]
        priority_class, runtime_class, grace, wait = want[component]
        assert (spec["priorityClassName"], spec["priority"]) == (priority_class, PRIORITIES[priority_class])
        assert spec["runtimeClassName"] == runtime_class and spec.get("overhead") == RUNTIMES[runtime_class]
        assert spec["schedulerName"] == "default-scheduler" and spec["terminationGracePeriodSeconds"] == grace
        if wait is not None:
            hook = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
            assert hook[-1] == f"import time; time.sleep({wait})", hook
        else:  # the router's anti-affinity, required here, to exactly this release's routers
            (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == helm.RELEASE


def test_unknown_classes_refuse_the_pods_not_the_workloads(cluster: ControlPlane) -> None:
    """What values.yaml says of priorityClassName and runtimeClassName: the workload is accepted,
    its pods are refused by admission (so the controller creates none), naming the class."""
    ns = "unknown-classes"
    cluster.apply([fleet.namespace(ns, POD_SECURITY["defaults"])])
    docs = helm.render(
        helm.helm_binaries()[0],
        sets=("prefill.priorityClassName=no-such-priority", "decode.runtimeClassName=no-such-runtime"),
        namespace=ns,
    )
    workloads = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "StatefulSet"}
    for component, why in (
        ("prefill", "no PriorityClass with name no-such-priority was found"),
        ("decode", 'RuntimeClass "no-such-runtime" not found'),
    ):
        proc = cluster.apply([workloads[component]], "--dry-run=server", check=False)
        assert proc.returncode == 0, proc.stderr
        ok, err = admitted(cluster, rendered.pod_of(workloads[component], ns))
        assert not ok and why in err, err


# Names on both sides of Kubernetes' rules: DNS-1123 subdomains of at most 253 characters for the
# class names, nothing at all for the scheduler name (v1.37.2: PodSpec.schedulerName has no
# validation).
NAMES = ["gpu-high", "a.b-c.d", "a" * 253, "a" * 254, "GPU_High", "a..b", "-a", "a-", "two words", "Sched: v2", "x/y"]


@pytest.mark.parametrize("field", ["priorityClassName", "runtimeClassName", "schedulerName"])
def test_the_chart_refuses_exactly_the_names_the_api_server_refuses(cluster: ControlPlane, field: str) -> None:
    """For each name: the chart's schema and the API server (a pod template's validation, no
    admission: a Deployment) agree on whether it is valid."""
    import json

    ns = "scheduling-names"
    cluster.apply([fleet.namespace(ns, "privileged")])
    disagree = []
    for name in NAMES:
        chart = helm.template(helm.helm_binaries()[0], values_yaml=f"prefill:\n  {field}: {json.dumps(name)}\n")
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "names", "namespace": ns},
            "spec": {
                "selector": {"matchLabels": {"app": "names"}},
                "template": {
                    "metadata": {"labels": {"app": "names"}},
                    "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}], field: name},
                },
            },
        }
        server = cluster.apply([deployment], "--dry-run=server", check=False)
        if (chart.returncode == 0) != (server.returncode == 0):
            disagree.append((name[:20], chart.stderr.strip()[-200:], server.stderr.strip()[-200:]))
        if server.returncode != 0:
            assert f"spec.template.spec.{field}" in server.stderr, server.stderr
        if chart.returncode != 0:
            assert f"/prefill/{field}" in chart.stderr, chart.stderr
    assert not disagree, disagree


# --- tracing and the Gateway API (issue 25): tests/values/tracing-gateway.yaml -------------------

TRACED = "scenario:tracing-gateway"


def test_tracing_and_gateway_objects_pass_strict_server_side_validation(cluster: ControlPlane) -> None:
    """Every object of the tracing and Gateway API values file as the API server keeps it, the
    HTTPRoute against the Gateway API's CRDs (its CEL rules included) and attached to a Gateway
    that exists; no Gateway controller runs here, so nobody accepts the route in its status
    (what a controller writes there is the controller's, not the chart's)."""
    from tests import cases

    ns = "traced-gateway"
    cluster.apply([fleet.namespace(ns, POD_SECURITY["defaults"]), fleet.namespace("gateways", "restricted")])
    cluster.apply(
        [
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "GatewayClass",
                "metadata": {"name": "inference"},
                "spec": {"controllerName": "example.com/gateway-controller"},
            },
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "Gateway",
                "metadata": {"name": "inference", "namespace": "gateways"},
                "spec": {
                    "gatewayClassName": "inference",
                    "listeners": [
                        {
                            "name": "https",
                            "protocol": "HTTPS",
                            "port": 443,
                            "hostname": "llm.example.com",
                            "tls": {"certificateRefs": [{"name": "llm-example-tls"}]},
                            "allowedRoutes": {"namespaces": {"from": "All"}},
                        }
                    ],
                },
            },
        ]
    )
    docs = helm.render(helm.helm_binaries()[0], cases.LAYERINGS[TRACED], namespace=ns)
    served = {(d["kind"], d["metadata"]["name"]): d for d in _served(cluster, docs)}
    route = served[("HTTPRoute", "pd-pd-inference-router")]
    (rule,) = route["spec"]["rules"]
    assert rule["timeouts"] == {"request": "2h", "backendRequest": "90m"}  # standard channel: kept
    assert rule["backendRefs"][0]["name"] == "pd-pd-inference-router"
    assert route["spec"]["parentRefs"][0]["sectionName"] == "https"
    cluster.apply([d for d in docs if d["kind"] == "HTTPRoute"])  # stored, not only dry-run
    ingress = served[("Ingress", "pd-pd-inference-router")]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"]["number"] == 8000
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    for component in ("prefill", "decode"):
        (pod,) = _served(cluster, [rendered.pod_of(workloads[f"pd-pd-inference-{component}"], ns)])
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"]["valueFrom"]["secretKeyRef"]["name"] == "otlp-headers"


# Gateway API durations on both sides of the rule that a try may not outlast the request
# (HTTPRouteRule timeouts, CEL in the v1.6.3 CRD); 0s turns a timeout off.
TIMEOUTS = [
    ("1h", "1h"),
    ("0s", "5h"),
    ("1h", "0s"),
    ("90m", "1h30m1s"),
    ("1h", "3601s"),
    ("500ms", "1s"),
    ("2h", "119m59s"),
]


def test_the_chart_refuses_exactly_the_route_timeouts_the_api_server_refuses(cluster: ControlPlane) -> None:
    ns = "route-timeouts"
    cluster.apply([fleet.namespace(ns, "restricted")])
    disagree = []
    for request, backend in TIMEOUTS:
        sets = (
            "router.httpRoute.enabled=true",
            "router.httpRoute.parentRefs[0].name=gw",
            f"router.httpRoute.timeouts.request={request}",
            f"router.httpRoute.timeouts.backendRequest={backend}",
        )
        chart = helm.template(helm.helm_binaries()[0], sets=sets)
        ok = helm.template(helm.helm_binaries()[0], sets=(*sets[:2], "router.httpRoute.timeouts.backendRequest=0s"))
        (route,) = [d for d in ok.docs if d["kind"] == "HTTPRoute"]
        route["metadata"]["namespace"] = ns
        route["spec"]["rules"][0]["timeouts"] = {"request": request, "backendRequest": backend}
        server = cluster.apply([route], "--dry-run=server", check=False)
        if (chart.returncode == 0) != (server.returncode == 0):
            disagree.append((request, backend, chart.stderr.strip()[-200:], server.stderr.strip()[-200:]))
    assert not disagree, disagree


def test_lmcache_mp_engine_pods_pass_strict_server_side_validation(cluster: ControlPlane) -> None:
    """LMCache's MP mode on the chart defaults (no EFA, whose engines need `privileged`): every
    object as the API server keeps it, and each engine pod, with its `lmcache-server` container,
    admitted in a namespace at the defaults' Pod Security level, `restricted`."""
    ns = "lmcache-mp"
    cluster.apply([fleet.namespace(ns, POD_SECURITY["defaults"])])
    sets = ("kvTransfer.nixl.lmcacheMp.enabled=true", "model.attention=full")
    docs = helm.render(helm.helm_binaries()[0], sets=sets, namespace=ns)
    _served(cluster, docs)
    for doc in docs:
        if doc["kind"] != "StatefulSet":
            continue
        (pod,) = _served(cluster, [rendered.pod_of(doc, ns)])
        names = [c["name"] for c in pod["spec"]["containers"]]
        assert "lmcache-server" in names, names


# --- several base models (issue 35): docs/examples/two-models/ ------------------------------------

TWO_MODELS = {"scenario:two-models-llama+prod": "two-models-llama", "scenario:two-models-qwen+prod": "two-models-qwen"}


def test_two_models_releases_pass_strict_server_side_validation_and_admission(cluster: ControlPlane) -> None:
    """docs/examples/two-models/: each release's objects as the API server keeps them, in a
    namespace of its own at prod's Pod Security level, and every pod of both admitted there;
    the fronting router's config names the other release's router (and the router's loader
    takes it), and each release's engines serve their own adapters only."""
    import yaml
    from pd_router.config import parse_config

    from tests import cases

    configs = {}
    for scenario, ns in TWO_MODELS.items():
        cluster.apply([fleet.namespace(ns, POD_SECURITY["prod"])])
        docs = helm.render(helm.helm_binaries()[0], cases.LAYERINGS[scenario], namespace=ns)
        served = _served(cluster, docs)
        assert {d["kind"] for d in served} >= {"StatefulSet", "Deployment", "ConfigMap", "NetworkPolicy"}
        pods = 0
        for doc in docs:
            if doc["kind"] in ("Deployment", "StatefulSet"):
                ok, why = admitted(cluster, rendered.pod_of(doc, ns))
                assert ok, (doc["metadata"]["name"], why)
                pods += 1
        assert pods == 3
        (cm,) = [d for d in served if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-router")]
        configs[ns] = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    front, other = configs["two-models-llama"], configs["two-models-qwen"]
    ((remote,),) = [front.remote_models]
    assert (remote.name, remote.url) == (other.model.served_name, "http://pd-pd-inference-router.pd-qwen.svc:8000")
    assert front.model.adapters == ["sql-expert", "support-bot"] and other.model.adapters == ["qwen-support"]
    assert other.remote_models == []
