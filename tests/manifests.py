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


# The label LeaderWorkerSet (v0.9.0) gives each pod of a group by its place: 0 is the leader.
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def engine_templates(docs: Docs, role: str) -> dict[str, dict[str, Any]]:
    """A role's engine pod templates by member: {"single": ...} from its StatefulSet, or
    {"leader": ..., "worker": ...} from its LeaderWorkerSet (<role>.nodes > 1), their labels with
    the worker-index the LWS controller adds to each pod (so selectors can be checked)."""
    groups = helm.find(docs, "LeaderWorkerSet", f"-{role}-lws")
    if not groups:
        return {"single": helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]}
    lwt = groups[0]["spec"]["leaderWorkerTemplate"]
    out = {}
    for member, key, index in (("leader", "leaderTemplate", "0"), ("worker", "workerTemplate", "1")):
        template = json.loads(json.dumps(lwt[key]))
        template["metadata"]["labels"][LWS_WORKER_INDEX] = index
        out[member] = template
    return out


def serving_template(docs: Docs, role: str) -> dict[str, Any]:
    """The pod template of the pods that serve a role's API: the StatefulSet's, or the leaders'."""
    templates = engine_templates(docs, role)
    return templates.get("single") or templates["leader"]


def container(docs: Docs, role: str) -> dict[str, Any]:
    """The engine container of a role ("prefill" or "decode"), of the pods that serve its API."""
    return serving_template(docs, role)["spec"]["containers"][0]


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


# Every engine role the chart knows, in the order it renders them.
ROLES = ("prefill", "decode")


def engine_roles(docs: Docs) -> tuple[str, ...]:
    """The engine roles a render runs, read from the router's pools: prefill and decode, or decode
    alone with one engine pool (engine.layout flexible)."""
    pools = router_config(docs)["pools"]
    return tuple(role for role in ROLES if role in pools)


def container_ports(docs: Docs, kind: str, suffix: str) -> dict[str, int]:
    c = pod_spec(docs, kind, suffix)["containers"][0]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def service_ports(docs: Docs, suffix: str) -> dict[str, int]:
    return {p["name"]: p["port"] for p in helm.one(docs, "Service", suffix)["spec"]["ports"]}


def policy_ports(docs: Docs, suffix: str) -> set[int]:
    """The single ports (not ranges) a NetworkPolicy's ingress rules open."""
    policy = helm.one(docs, "NetworkPolicy", suffix)
    return {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"] if "endPort" not in p}
