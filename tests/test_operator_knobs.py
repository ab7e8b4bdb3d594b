"""The knobs operators reach for (issue 22): priorityClassName, runtimeClassName and schedulerName
per role; the engines' graceful drain (preStop, grace period, vLLM's shutdown timeout); KEDA's
pollingInterval, cooldownPeriod and fallback and the HPAs' behavior; the model-cache claims'
retention policy; the router's anti-affinity, scoped to its release. Each renders when set and
stays out when not; bad values are in tests/test_bad_values.py, the API server's verdict in
tests/cluster/test_admission.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import helm
from tests.cases import LAYERINGS, LMCACHE
from tests.manifests import pod_spec, router_config

ROLES = {
    "prefill": ("StatefulSet", "-prefill"),
    "decode": ("StatefulSet", "-decode"),
    "router": ("Deployment", "-router"),
}
SCHEDULING = ("priorityClassName", "runtimeClassName", "schedulerName")
KEDA = "keda.sh/v1alpha1/ScaledObject"
# What a KEDA queue trigger needs around it (templates/_validate.tpl).
KEDA_QUEUE = "metrics:\n  prometheusUrl: http://prometheus:9090\n  podMonitor: {enabled: true}\n"


def _spec(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return pod_spec(docs, *ROLES[role])


# --- priorityClassName, runtimeClassName, schedulerName ------------------------------------------


def test_scheduling_names_are_not_rendered_by_default(h4: Path) -> None:
    docs = helm.render(h4)
    for role in ROLES:
        spec = _spec(docs, role)
        assert not set(SCHEDULING) & set(spec), (role, sorted(set(SCHEDULING) & set(spec)))


@pytest.mark.parametrize("field", SCHEDULING)
@pytest.mark.parametrize("role", ROLES)
def test_a_scheduling_name_renders_on_its_role_only(h4: Path, role: str, field: str) -> None:
    docs = helm.render(h4, sets=(f"{role}.{field}=gpu-fleet.example.com",))
    for other in ROLES:
        assert _spec(docs, other).get(field) == ("gpu-fleet.example.com" if other == role else None), other


# --- the router's anti-affinity ------------------------------------------------------------------


def _router_anti_affinity(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _spec(docs, "router").get("affinity", {}).get("podAntiAffinity", {})


def test_router_anti_affinity_selects_this_releases_routers_only(h4: Path) -> None:
    """Preferred by default, on the node, with the chart's selector labels: the release's router
    pods match it, another release's router pods (same component label) do not."""
    mine = helm.render(h4, release="alpha")
    other = helm.render(h4, release="beta")
    (term,) = _router_anti_affinity(mine)["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100 and term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]
    assert set(selector) == {"matchLabels"}
    wanted = selector["matchLabels"]
    assert wanted == helm.one(mine, "Deployment", "-router")["spec"]["selector"]["matchLabels"]
    labels = {
        name: helm.one(d, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
        for name, d in (("mine", mine), ("other", other))
    }
    assert wanted.items() <= labels["mine"].items()
    assert not wanted.items() <= labels["other"].items()  # beta's routers are not repelled by alpha's
    assert labels["other"]["app.kubernetes.io/component"] == "router"  # though they share the component


def test_router_anti_affinity_required_none_and_merged(h4: Path) -> None:
    required = _router_anti_affinity(helm.render(h4, sets=("router.antiAffinity=required",)))
    (term,) = required["requiredDuringSchedulingIgnoredDuringExecution"]
    assert (
        term["topologyKey"] == "kubernetes.io/hostname"
        and "preferredDuringSchedulingIgnoredDuringExecution" not in required
    )
    assert "affinity" not in _spec(helm.render(h4, sets=("router.antiAffinity=none",)), "router")
    # The user's affinity stays, the chart's term is added to it.
    values = (
        "router:\n  affinity:\n    nodeAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n"
        "        nodeSelectorTerms: [{matchExpressions: [{key: pool, operator: In, values: [cpu]}]}]\n"
        "    podAntiAffinity:\n      preferredDuringSchedulingIgnoredDuringExecution:\n"
        "        - {weight: 10, podAffinityTerm: {topologyKey: topology.kubernetes.io/zone, labelSelector: {matchLabels: {team: x}}}}\n"
    )
    affinity = _spec(helm.render(h4, values_yaml=values), "router")["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    weights = [t["weight"] for t in affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]]
    assert weights == [10, 100]


def test_prod_router_anti_affinity_is_scoped_to_its_release(h4: Path) -> None:
    """values/prod.yaml used to select `app.kubernetes.io/component: router` alone, so its routers
    avoided every release's routers; now the chart's selector (instance included) does it."""
    docs = helm.render(h4, LAYERINGS["env:prod"])
    (term,) = _router_anti_affinity(docs)["preferredDuringSchedulingIgnoredDuringExecution"]
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector == helm.one(docs, "Deployment", "-router")["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/instance"] == helm.RELEASE


# --- the model-cache claims' retention -----------------------------------------------------------


def test_pvc_retention_policy_only_with_claims(h4: Path) -> None:
    default = helm.render(h4)  # emptyDir: no claims, nothing to retain
    for role in ("prefill", "decode"):
        assert "persistentVolumeClaimRetentionPolicy" not in helm.one(default, "StatefulSet", f"-{role}")["spec"]
    pvc = helm.render(h4, sets=("modelCache.type=pvc",))
    for role in ("prefill", "decode"):
        sts = helm.one(pvc, "StatefulSet", f"-{role}")["spec"]
        assert sts["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    chosen = helm.render(h4, sets=("modelCache.type=pvc", "modelCache.pvc.retentionPolicy.whenScaled=Delete"))
    for role in ("prefill", "decode"):
        sts = helm.one(chosen, "StatefulSet", f"-{role}")["spec"]
        assert sts["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Delete"}


# --- KEDA and HPA --------------------------------------------------------------------------------

BEHAVIOR = {
    "scaleDown": {"stabilizationWindowSeconds": 600, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]}
}
BEHAVIOR_YAML = (
    "    behavior:\n      scaleDown:\n        stabilizationWindowSeconds: 600\n"
    "        policies: [{type: Pods, value: 1, periodSeconds: 300}]\n"
)


def test_hpa_behavior_only_when_set(h4: Path) -> None:
    hpa_values = (
        "router:\n  autoscaling:\n    enabled: true\n"
        "decode:\n  autoscaling:\n    enabled: true\n    targetWaitingPerReplica: 4\nmetrics:\n  podMonitor: {enabled: true}\n"
    )
    plain = helm.render(h4, values_yaml=hpa_values)
    for suffix in ("-router", "-decode"):
        assert "behavior" not in helm.one(plain, "HorizontalPodAutoscaler", suffix)["spec"]
    shaped = helm.render(
        h4, values_yaml=hpa_values.replace("    enabled: true\n", "    enabled: true\n" + BEHAVIOR_YAML)
    )
    for suffix in ("-router", "-decode"):
        assert helm.one(shaped, "HorizontalPodAutoscaler", suffix)["spec"]["behavior"] == BEHAVIOR


def test_keda_settings_are_explicit_and_fallback_and_behavior_follow_the_values(h4: Path) -> None:
    keda = KEDA_QUEUE + "decode:\n  autoscaling:\n    enabled: true\n    kind: keda\n    targetWaitingPerReplica: 8\n"
    plain = helm.one(helm.render(h4, values_yaml=keda), "ScaledObject", "-decode")["spec"]
    # KEDA's own defaults (v2.20.2 pkg/scaling/executor: 30 s, 300 s), written out.
    assert (plain["pollingInterval"], plain["cooldownPeriod"]) == (30, 300)
    assert "fallback" not in plain and "advanced" not in plain
    tuned = keda + (
        "    keda:\n      pollingInterval: 15\n      cooldownPeriod: 120\n"
        "      fallback: {replicas: 3, failureThreshold: 5, behavior: currentReplicasIfHigher}\n" + BEHAVIOR_YAML
    )
    spec = helm.one(helm.render(h4, values_yaml=tuned), "ScaledObject", "-decode")["spec"]
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 120)
    assert spec["fallback"] == {"failureThreshold": 5, "replicas": 3, "behavior": "currentReplicasIfHigher"}
    assert spec["advanced"] == {"horizontalPodAutoscalerConfig": {"behavior": BEHAVIOR}}
    # The fallback's trigger rule counts the chart's queue trigger and the user's own.
    user_trigger = (
        "decode:\n  autoscaling: {enabled: true, kind: keda, keda: {fallback: {replicas: 1}},"
        " kedaTriggers: [{type: cpu, metricType: Utilization, metadata: {value: '80'}},"
        " {type: prometheus, metadata: {serverAddress: 'http://p:9090', query: 'sum(up)', threshold: '1'}}]}\n"
    )
    assert (
        helm.one(helm.render(h4, values_yaml=user_trigger), "ScaledObject", "-decode")["spec"]["fallback"]["replicas"]
        == 1
    )


def test_prefill_keda_settings_too(h4: Path) -> None:
    values = KEDA_QUEUE + (
        "prefill:\n  autoscaling:\n    enabled: true\n    kind: keda\n    targetWaitingPerReplica: 2\n"
        "    keda: {pollingInterval: 10, fallback: {replicas: 2}}\n    maxReplicas: 3\n"
    )
    spec = helm.one(helm.render(h4, values_yaml=values), "ScaledObject", "-prefill")["spec"]
    assert spec["pollingInterval"] == 10 and spec["fallback"]["replicas"] == 2
    assert spec["fallback"]["behavior"] == "static" and spec["fallback"]["failureThreshold"] == 3


def test_lmcache_renders_the_knobs_alike(h4: Path) -> None:
    """The LMCache layering (another pod shape: the notification sidecar) takes the same knobs."""
    docs = helm.render(
        h4,
        (LMCACHE,),
        sets=(
            "kvTransfer.lmcache.notificationReceiver=prefillSidecar",
            "prefill.priorityClassName=gpu",
            "router.replicas=2",
        ),
    )
    assert _spec(docs, "prefill")["priorityClassName"] == "gpu"
    assert "priorityClassName" not in _spec(docs, "decode")


# --- the engines' drain --------------------------------------------------------------------------


def _containers(docs: list[dict[str, Any]], role: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in _spec(docs, role)["containers"]}


def _pre_stop(container: dict[str, Any]) -> list[str]:
    return container["lifecycle"]["preStop"]["exec"]["command"]


def test_drain_numbers_come_from_the_routers_discovery_interval(h4: Path) -> None:
    """The preStop wait is the router's re-resolution interval (the one its config file renders)
    plus the DNS answers' lifetime; vLLM then drains for drainSeconds (--shutdown-timeout; vLLM
    0.31.0 and 0.33.0 default to 0, abort); the grace period covers both."""
    docs = helm.render(h4)
    refresh = {p["dns"]["refreshSeconds"] for p in router_config(docs)["pools"].values()}
    assert refresh == {10}
    for role in ("prefill", "decode"):
        spec = _spec(docs, role)
        vllm = spec["containers"][0]
        assert _pre_stop(vllm) == ["python3", "-c", "import time; time.sleep(17)"]  # 10 + 7
        assert "--shutdown-timeout=90" in vllm["args"]
        assert spec["terminationGracePeriodSeconds"] == 150 > 17 + 90
        assert "lifecycle" not in _containers(docs, role)["metrics-proxy"]  # nothing to drain there
    moved = helm.render(
        h4,
        sets=(
            "router.discoveryRefreshSeconds=30",
            "engine.drain.dnsCacheSeconds=20",
            "engine.preflight.python=/opt/venv/bin/python",
            "decode.drainSeconds=600",
            "decode.terminationGracePeriodSeconds=700",
            "prefill.drainSeconds=0",
        ),
    )
    assert {p["dns"]["refreshSeconds"] for p in router_config(moved)["pools"].values()} == {30}
    decode = _spec(moved, "decode")
    assert _pre_stop(decode["containers"][0]) == ["/opt/venv/bin/python", "-c", "import time; time.sleep(50)"]
    assert "--shutdown-timeout=600" in decode["containers"][0]["args"]
    assert decode["terminationGracePeriodSeconds"] == 700
    assert "--shutdown-timeout=0" in _spec(moved, "prefill")["containers"][0]["args"]  # abort, as asked


def test_a_grace_period_that_does_not_cover_the_drain_is_refused(h4: Path) -> None:
    result = helm.template(h4, sets=("decode.drainSeconds=103", "decode.terminationGracePeriodSeconds=120"))
    assert result.returncode != 0
    for text in (
        "decode.terminationGracePeriodSeconds",
        "router.discoveryRefreshSeconds 10",
        "engine.drain.dnsCacheSeconds 7",
        "decode.drainSeconds (103 s)",
        "above 120",
    ):
        assert text in result.stderr, (text, result.stderr)
    # One second more is enough for the rule (the rest is the operator's call: vLLM's teardown).
    assert (
        helm.template(h4, sets=("decode.drainSeconds=102", "decode.terminationGracePeriodSeconds=120")).returncode == 0
    )


def test_engine_headless_services_never_publish_terminating_pods(h4: Path) -> None:
    """What the preStop wait relies on: a terminating pod (not ready) leaves the answers."""
    docs = helm.render(h4)
    for role in ("prefill", "decode"):
        svc = helm.one(docs, "Service", f"-{role}")["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is False


def test_notification_sidecar_waits_while_vllm_serves(h4: Path, tmp_path: Path) -> None:
    """The LMCache notification sidecar must outlive vLLM's drain (the router asks it about the
    prefills vLLM still finishes), and no longer: its preStop script, run here for real, returns
    once nothing listens on vLLM's port, or at preStop + drainSeconds at the latest."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    docs = helm.render(
        h4,
        (LMCACHE,),
        sets=(
            "kvTransfer.lmcache.notificationReceiver=prefillSidecar",
            f"ports.engineHttp={port}",
            "router.discoveryRefreshSeconds=1",
            "engine.drain.dnsCacheSeconds=0",
            "prefill.drainSeconds=20",
        ),
    )
    containers = _containers(docs, "prefill")
    assert _pre_stop(containers["vllm"]) == ["python3", "-c", "import time; time.sleep(1)"]
    python, flag, script = _pre_stop(containers["notify-sidecar"])
    assert (python, flag) == ("python3", "-c") and "+ 21\n" in script  # 1 + 20
    assert "lifecycle" not in containers["metrics-proxy"]
    server = socket.create_server(("127.0.0.1", port))
    try:
        started = time.monotonic()
        hook = subprocess.Popen([sys.executable, "-c", script])
        time.sleep(3)
        assert hook.poll() is None, "the sidecar's wait ended while vLLM's port was open"
        server.close()
        hook.wait(timeout=10)
        took = time.monotonic() - started
    finally:
        server.close()
    assert hook.returncode == 0 and 3 <= took < 8, took
    # vLLM already gone: the first wait only.
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=10)
    assert 1 <= time.monotonic() - started < 4


def test_a_router_drops_an_engine_that_left_dns_within_the_prestop_wait(h4: Path) -> None:
    """The contract the preStop wait is computed from, against the router's own discovery code
    (pd_router.discovery.EndpointPool, with the chart-rendered config): an address the DNS stops
    returning leaves the router's pool within one discoveryRefreshSeconds; the preStop wait adds
    the DNS answers' lifetime to that."""
    import asyncio
    import time

    from pd_router.config import parse_config
    from pd_router.discovery import EndpointPool

    docs = helm.render(h4, sets=("router.discoveryRefreshSeconds=1", "engine.drain.dnsCacheSeconds=2"))
    (_, _, wait) = _pre_stop(_spec(docs, "decode")["containers"][0])
    assert wait == "import time; time.sleep(3)"
    cfg = parse_config(router_config(docs), env={})
    refresh = cfg.pools.decode.dns.refresh_seconds
    assert refresh == 1

    async def scenario() -> float:
        answers = ["10.0.0.1", "10.0.0.2"]
        pool = EndpointPool("decode", cfg.pools.decode, cfg.health)

        async def resolve() -> list[str]:
            return [f"http://{ip}:8000" for ip in answers]

        async def no_checks(eps: object = None) -> None:  # no engines behind the addresses
            return None

        pool.resolve = resolve  # type: ignore[method-assign]
        pool.check_all = no_checks  # type: ignore[method-assign]
        await pool.start(session=None)  # type: ignore[arg-type]
        try:
            assert set(pool.endpoints) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
            await asyncio.sleep(refresh * 0.6)  # somewhere within a refresh interval
            answers.remove("10.0.0.2")  # the DNS stops answering with the terminating pod
            left = time.monotonic()
            while "http://10.0.0.2:8000" in pool.endpoints:
                await asyncio.sleep(0.01)
            return time.monotonic() - left
        finally:
            await pool.stop()

    took = asyncio.run(scenario())
    assert took <= refresh + 1.0 and took < 3, took  # one interval and the loop's lag: inside the wait


def test_a_scheduler_name_is_taken_as_kubernetes_takes_it(h4: Path) -> None:
    """Kubernetes does not check PodSpec.schedulerName's format (v1.37.2: no validation), so
    neither does the chart: it renders any name, quoted (tests/cluster/test_admission.py has the
    API server accept the same names)."""
    values = "router:\n  schedulerName: 'Team Scheduler: v2'\n"
    assert _spec(helm.render(h4, values_yaml=values), "router")["schedulerName"] == "Team Scheduler: v2"
