"""What the chart renders for observability, offline: the dashboard ConfigMap, the alerts per
connector and their values, the ServiceMonitor's credential. (The live tests prove they work.)"""

from __future__ import annotations

import json
from pathlib import Path

from tests import helm
from tests.cases import LMCACHE
from tests.observability.prom import DASHBOARD

ON = "metrics:\n  serviceMonitor: {enabled: true}\n  podMonitor: {enabled: true}\n  prometheusRule: {enabled: true}\n"


def _alerts(docs: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in helm.one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}


def test_the_dashboard_configmap_carries_the_dashboard_for_the_sidecar(h4: Path) -> None:
    assert not helm.find(helm.render(h4), "ConfigMap", "-dashboard")
    values = "metrics:\n  grafanaDashboard:\n    enabled: true\n    namespace: monitoring\n    annotations: {grafana_folder: LLM}\n"
    cm = helm.one(helm.render(h4, values_yaml=values), "ConfigMap", "-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["pd-inference.json"]) == json.loads(DASHBOARD.read_text())


def test_alerts_follow_the_connector_and_the_values(h4: Path) -> None:
    nixl = _alerts(helm.render(h4, values_yaml=ON))
    lmcache = _alerts(helm.render(h4, (LMCACHE,), values_yaml=ON))
    assert "PDInferenceNixlTransferFailures" in nixl and "PDInferenceLMCacheNotificationTimeouts" not in nixl
    assert "PDInferenceLMCacheNotificationTimeouts" in lmcache and "PDInferenceNixlTransferFailures" not in lmcache
    tuned = (
        ON
        + "  prometheusRule:\n    enabled: true\n    alertLabels: {team: inference}\n    thresholds: {kvCacheUsage: 0.8}\n"
    )
    alert = _alerts(helm.render(h4, values_yaml=tuned))["PDInferenceKVCacheNearFull"]
    assert alert["expr"].endswith("> 0.8") and alert["labels"] == {"severity": "warning", "team": "inference"}
    for rule in nixl.values():
        assert f'namespace="{helm.NAMESPACE}",release="{helm.RELEASE}"' in rule["expr"], rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith("docs/operating.md#" + rule["alert"].lower())


def test_alert_runbooks_exist_in_the_readme(h4: Path) -> None:
    readme = (helm.ROOT / "docs" / "operating.md").read_text()
    names = set(_alerts(helm.render(h4, values_yaml=ON))) | set(_alerts(helm.render(h4, (LMCACHE,), values_yaml=ON)))
    missing = [n for n in sorted(names) if f"\n#### {n}\n" not in readme]
    assert not missing, f"docs/operating.md needs a runbook heading for {missing}"


def test_the_servicemonitor_sends_the_metrics_token_only_when_metrics_are_protected(h4: Path) -> None:
    open_ = helm.one(helm.render(h4, values_yaml=ON), "ServiceMonitor")
    assert "authorization" not in open_["spec"]["endpoints"][0]
    protected = (
        ON
        + "router:\n  auth:\n    existingSecret: keys\n    protectMetrics: true\n    metricsTokenSecret: {name: scrape, key: t}\n"
    )
    docs = helm.render(h4, values_yaml=protected)
    ep = helm.one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": "scrape", "key": "t"}}
    pod = helm.one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "metrics-token"]
    assert vol["secret"] == {"secretName": "scrape", "items": [{"key": "t", "path": "t"}]}


def test_the_fallback_alert_leaves_out_exactly_the_routers_request_caused_reasons(h4: Path) -> None:
    """PDInferenceFallbackShareHigh counts broken hand-offs, not requests the hand-off cannot
    carry, nor rollouts (an alert of their own): its exclusion list is the router's CLIENT_CAUSED
    and ROLLOUT (pd_router.metrics)."""
    import re

    from pd_router import metrics

    on = ("prometheusRule", "serviceMonitor", "podMonitor")
    docs = helm.render(h4, sets=(*(f"metrics.{o}.enabled=true" for o in on), "crds.assumeInstalled=true"))
    rules = [r for g in helm.one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    (expr,) = [r["expr"] for r in rules if r["alert"] == "PDInferenceFallbackShareHigh"]
    (excluded,) = re.findall(r'reason!~"([^"]+)"', expr)
    assert sorted(excluded.split("|")) == sorted(metrics.CLIENT_CAUSED + metrics.ROLLOUT)
