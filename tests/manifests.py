"""Reading rendered objects: the pieces of the chart's output that tests of several files look at
(engine containers, configs, ports). Each takes the documents of one render (tests/helm.py)."""

from __future__ import annotations

import json
from typing import Any

import yaml

from tests import helm

Docs = list[dict[str, Any]]


def pod_spec(docs: Docs, kind: str, suffix: str) -> dict[str, Any]:
    return helm.one(docs, kind, suffix)["spec"]["template"]["spec"]


def container(docs: Docs, role: str) -> dict[str, Any]:
    """The engine container of a role ("prefill" or "decode")."""
    return pod_spec(docs, "StatefulSet", f"-{role}")["containers"][0]


def kv_transfer_config(docs: Docs, role: str) -> dict[str, Any]:
    args = container(docs, role)["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def env(docs: Docs, role: str) -> dict[str, Any]:
    """The engine container's env: literal values, and valueFrom entries as their source."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(docs, role)["env"]}


def lmcache_config(docs: Docs, role: str) -> dict[str, Any]:
    """The LMCache config file of a role (its ConfigMap's lmcache.yaml), parsed."""
    return yaml.safe_load(helm.one(docs, "ConfigMap", f"-{role}-lmcache")["data"]["lmcache.yaml"])


def router_config(docs: Docs) -> dict[str, Any]:
    """The router's config file (its ConfigMap's router.yaml), parsed."""
    return yaml.safe_load(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])


def container_ports(docs: Docs, kind: str, suffix: str) -> dict[str, int]:
    c = pod_spec(docs, kind, suffix)["containers"][0]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def service_ports(docs: Docs, suffix: str) -> dict[str, int]:
    return {p["name"]: p["port"] for p in helm.one(docs, "Service", suffix)["spec"]["ports"]}


def policy_ports(docs: Docs, suffix: str) -> set[int]:
    """The single ports (not ranges) a NetworkPolicy's ingress rules open."""
    policy = helm.one(docs, "NetworkPolicy", suffix)
    return {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"] if "endPort" not in p}
