"""The scrape configs the Prometheus Operator generates from the chart's ServiceMonitor and
PodMonitor, for targets on loopback.

Checked against prometheus-operator v0.93.0, pkg/prometheus/promcfg.go (generatePodMonitorConfig,
generateServiceMonitorConfig): job_name, the selector keep rules (matchLabels in sorted key order,
then matchExpressions), the port filter, the namespace/container/pod (and service) labels, `job`,
`endpoint`, then the monitor's own relabelings; `authorization` becomes inline credentials read
from the Secret in the monitor's namespace, untrimmed. Kubernetes service discovery is replaced by
static targets that carry the `__meta_kubernetes_*` labels it would attach (Prometheus lets
relabeling read `__meta_*` labels of static targets and drops them afterwards: scrape/target.go
PopulateLabels); so the monitors' selectors and relabelings run unchanged in the real Prometheus.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


@dataclass(frozen=True)
class Target:
    """One pod as Kubernetes SD would see it."""

    address: str  # host:port on loopback
    namespace: str
    pod: str
    container: str
    port_name: str
    pod_labels: dict[str, str]
    service: str = ""
    service_labels: dict[str, str] | None = None

    def meta(self, role: str) -> dict[str, str]:
        m = {
            "__address__": self.address,
            "__meta_kubernetes_namespace": self.namespace,
            "__meta_kubernetes_pod_name": self.pod,
            "__meta_kubernetes_pod_container_name": self.container,
            "__meta_kubernetes_pod_container_port_name": self.port_name,
            "__meta_kubernetes_pod_phase": "Running",
        }
        for k, v in self.pod_labels.items():
            m[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = v
            m[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
        if role == "endpoints":
            m["__meta_kubernetes_service_name"] = self.service
            m["__meta_kubernetes_endpoint_port_name"] = self.port_name
            m["__meta_kubernetes_endpoint_address_target_kind"] = "Pod"
            m["__meta_kubernetes_endpoint_address_target_name"] = self.pod
            for k, v in (self.service_labels or {}).items():
                m[f"__meta_kubernetes_service_label_{sanitize(k)}"] = v
                m[f"__meta_kubernetes_service_labelpresent_{sanitize(k)}"] = "true"
        return m


def _relabel(r: dict[str, Any]) -> dict[str, Any]:
    """A monitor's RelabelConfig (camelCase) as Prometheus relabel_config; only fields set."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
             "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}  # fmt: skip
    out = {names[k]: v for k, v in r.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def _selector_rules(selector: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    rules = []
    for k in sorted(selector.get("matchLabels", {})):
        v = selector["matchLabels"][k]
        rules.append({"action": "keep", "source_labels": [f"__meta_kubernetes_{kind}_label_{sanitize(k)}", f"__meta_kubernetes_{kind}_labelpresent_{sanitize(k)}"], "regex": f"({v});true"})  # fmt: skip
    for e in selector.get("matchExpressions", []):
        key = sanitize(e["key"])
        op = e["operator"]
        if op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop", "source_labels": [f"__meta_kubernetes_{kind}_label_{key}", f"__meta_kubernetes_{kind}_labelpresent_{key}"], "regex": f"({'|'.join(e['values'])});true"})  # fmt: skip
        else:
            rules.append({"action": "keep" if op == "Exists" else "drop", "source_labels": [f"__meta_kubernetes_{kind}_labelpresent_{key}"], "regex": "true"})  # fmt: skip
    return rules


def _auth(endpoint: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, Any]:
    auth = endpoint.get("authorization")
    if not auth:
        return {}
    ref = auth["credentials"]
    secret = secrets.get(ref["name"], {})
    if ref["key"] not in secret:  # the operator rejects the whole monitor
        raise AssertionError(f"Secret {ref['name']} has no key {ref['key']}: the operator would reject the monitor")
    return {
        "authorization": {"type": auth.get("type", "Bearer").strip() or "Bearer", "credentials": secret[ref["key"]]}
    }


def pod_monitor(pm: dict[str, Any], targets: list[Target]) -> list[dict[str, Any]]:
    ns, name = pm["metadata"]["namespace"], pm["metadata"]["name"]
    out = []
    for i, ep in enumerate(pm["spec"]["podMetricsEndpoints"]):
        relabel = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
            *_selector_rules(pm["spec"]["selector"], "pod"),
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"]},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{ns}/{name}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
            *[_relabel(r) for r in ep.get("relabelings", [])],
        ]
        out.append({
            "job_name": f"podMonitor/{ns}/{name}/{i}",
            "metrics_path": ep.get("path", "/metrics"),
            "static_configs": [{"targets": [t.address], "labels": t.meta("pod")} for t in targets],
            "relabel_configs": relabel,
        })  # fmt: skip
    return out


def service_monitor(
    sm: dict[str, Any], targets: list[Target], secrets: dict[str, dict[str, str]], drop_auth: bool = False
) -> list[dict[str, Any]]:
    ns, name = sm["metadata"]["namespace"], sm["metadata"]["name"]
    out = []
    for i, ep in enumerate(sm["spec"]["endpoints"]):
        relabel = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            *_selector_rules(sm["spec"]["selector"], "service"),
            {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": ep["port"]},
            {
                "source_labels": [
                    "__meta_kubernetes_endpoint_address_target_kind",
                    "__meta_kubernetes_endpoint_address_target_name",
                ],
                "separator": ";",
                "regex": "Node;(.*)",
                "replacement": "${1}",
                "target_label": "node",
            },  # fmt: skip
            {
                "source_labels": [
                    "__meta_kubernetes_endpoint_address_target_kind",
                    "__meta_kubernetes_endpoint_address_target_name",
                ],
                "separator": ";",
                "regex": "Pod;(.*)",
                "replacement": "${1}",
                "target_label": "pod",
            },  # fmt: skip
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
            *[_relabel(r) for r in ep.get("relabelings", [])],
        ]
        cfg = {
            "job_name": f"serviceMonitor/{ns}/{name}/{i}" + ("/without-credentials" if drop_auth else ""),
            "metrics_path": ep.get("path", "/metrics"),
            "static_configs": [{"targets": [t.address], "labels": t.meta("endpoints")} for t in targets],
            "relabel_configs": relabel,
        }
        if not drop_auth:
            cfg.update(_auth(ep, secrets))
        out.append(cfg)
    return out
