"""The flexible engine layout (engine.layout: flexible): one pool, the decode StatefulSet, whose every
engine takes either part of a hand-off (NixlConnector kv_both); nothing of the prefill role renders;
the router gets one pool and no pools.prefill; decode pods reach each other's KV ports exactly as
split's decoders reach the prefillers'; decoders share a zone among themselves. And the router's
goodput decision (router.decision: goodput), whose SLOs reach the router's config only with it.
The refusals are in tests/test_bad_values.py, the vLLM parsers' reading of kv_both in
tests/engines/test_engine_vllm_cli.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pd_router.config import ConfigError, Goodput, parse_config

from tests import helm, manifests
from tests.cases import LAYERINGS
from tests.manifests import container, kv_transfer_config, pod_spec, router_config
from tests.test_ports_and_policies import _allowed_from, _pod_labels, _selects

SCENARIO = LAYERINGS["scenario:flexible"]
FLEXIBLE = ("engine.layout=flexible", "prefill.replicas=0")
GOODPUT = ("router.decision=goodput",)
ZONE = "topology.kubernetes.io/zone"
# What would render prefill objects in split: more than one prefiller (a PDB), an autoscaler's
# neighbour, egress policies, every monitor, the dashboard, a multi-node prefill role.
EVERYTHING = (
    "networkPolicy.egress.enabled=true",
    "metrics.podMonitor.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.grafanaDashboard.enabled=true",
    "decode.replicas=3",
    "decode.autoscaling.enabled=true",
    "decode.autoscaling.targetWaitingPerReplica=4",
    "decode.autoscaling.minReplicas=2",
)


def test_the_scenario_is_the_dev_environment_as_argo_cd_renders_it_made_flexible() -> None:
    assert SCENARIO[:-1] == LAYERINGS["env:dev"]
    assert yaml.safe_load((helm.ROOT / SCENARIO[-1]).read_text()) == {
        "engine": {"layout": "flexible"},
        "prefill": {"replicas": 0},
        "decode": {"replicas": 2},
        "router": {"decision": "goodput"},
    }


@pytest.mark.parametrize("files,backend", [((), "UCX"), (SCENARIO, "LIBFABRIC")], ids=["defaults", "scenario"])
def test_the_decode_engines_take_either_part(h4: Path, files: tuple[str, ...], backend: str) -> None:
    docs = helm.render(h4, files, () if files else FLEXIBLE)
    cfg = kv_transfer_config(docs, "decode")
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector"] == "NixlConnector" and cfg["kv_connector_extra_config"] == {"backends": [backend]}
    # negative control: the same values in split keep producer and consumer
    split = helm.render(h4, files, ("engine.layout=split", "prefill.replicas=1"))
    assert (kv_transfer_config(split, "prefill")["kv_role"], kv_transfer_config(split, "decode")["kv_role"]) == (
        "kv_producer",
        "kv_consumer",
    )


def _prefill_objects(docs: list[dict[str, Any]]) -> list[str]:
    return [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if "prefill" in d["metadata"]["name"]
        or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "prefill"
    ]


def test_nothing_of_the_prefill_role_renders(h4: Path) -> None:
    # prefill.nodes 2 would make the prefill role a LeaderWorkerSet in split: not rendered either
    result = helm.template(
        h4, sets=(*FLEXIBLE, *GOODPUT, *EVERYTHING, "prefill.nodes=2", "prefill.tensorParallelSize=2")
    )
    assert result.returncode == 0, result.stderr
    assert _prefill_objects(result.docs) == []
    # no object names, selects or reaches a prefill pod
    assert "-prefill" not in result.stdout and "component: prefill" not in result.stdout
    assert 'component="prefill"' not in result.stdout and 'pool="prefill"' not in result.stdout
    assert "kind: LeaderWorkerSet" not in result.stdout
    monitor = helm.one(result.docs, "PodMonitor")["spec"]["selector"]["matchExpressions"]
    assert {"key": "app.kubernetes.io/component", "operator": "In", "values": ["decode"]} in monitor
    kinds = {d["kind"] for d in result.docs if d["metadata"]["name"].endswith("-decode")}
    assert kinds == {"StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    # negative control: split renders the prefill role's objects from the same values
    split = helm.render(h4, sets=(*EVERYTHING, "prefill.replicas=2"))
    assert {o.split("/")[0] for o in _prefill_objects(split)} >= {
        "StatefulSet",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }


def test_the_router_gets_one_pool_and_no_prefill_section(h4: Path) -> None:
    docs = helm.render(h4, SCENARIO)
    pools = router_config(docs)["pools"]
    assert set(pools) == {"layout", "decode"} and pools["layout"] == "flexible"
    assert pools["decode"]["dns"]["name"] == f"pd-pd-inference-decode.{helm.NAMESPACE}.svc.cluster.local"
    config = parse_config(router_config(docs), env={})
    assert config.pools.layout == "flexible" and config.routing.connector == "nixl"
    assert manifests.engine_roles(docs) == ("decode",)
    # split renders no layout key (the router's default) and both pools
    split = router_config(helm.render(h4, LAYERINGS["env:dev"]))["pools"]
    assert set(split) == {"prefill", "decode"}
    # the router's loader refuses a flexible config with a prefill pool: the chart never renders one
    with pytest.raises(ConfigError, match="pools.prefill"):
        parse_config({**router_config(docs), "pools": {**pools, "prefill": split["prefill"]}}, env={})


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _as_values(obj: Any) -> Any:
    """A router config dataclass as the camelCase mapping its YAML takes."""
    if dataclasses.is_dataclass(obj):
        return {_camel(f.name): _as_values(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def test_goodput_slos_render_only_with_the_goodput_decision(h4: Path) -> None:
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text())["router"]["goodput"]
    # the chart's defaults are the router's
    assert values == _as_values(Goodput())
    rendered = router_config(helm.render(h4, SCENARIO))["routing"]
    assert rendered["decision"] == "goodput" and rendered["goodput"] == values
    # with a split layout too (goodput needs NIXL, not one pool)
    assert router_config(helm.render(h4, sets=GOODPUT))["routing"]["goodput"] == values
    for decision in ("prefix", "length"):
        assert "goodput" not in router_config(helm.render(h4, sets=(f"router.decision={decision}",)))["routing"]
        assert (
            "goodput" not in router_config(helm.render(h4, sets=(*FLEXIBLE, f"router.decision={decision}")))["routing"]
        )


def test_goodput_values_reach_the_router_as_numbers(h4: Path) -> None:
    """Values of every size: Go writes 5e-05 and 1e+06 without a point, which YAML 1.1 (the
    router's PyYAML) would read as strings; the chart gives them one."""
    values = {
        "router": {
            "decision": "goodput",
            "goodput": {
                "ttftSeconds": 2.5,
                "ttftSecondsPerKiloToken": 0,
                "itlSeconds": 0.05,
                "windowSeconds": 30,
                "seed": {
                    "prefillTokensPerSecond": 1000000.0,
                    "decodeStepSeconds": 0.00005,
                    "handoffSeconds": 0.002,
                    "chunkTokens": 8192,
                    "crowding": 2.1,
                },
            },
        }
    }
    docs = helm.render(h4, values_yaml=json.dumps(values))
    g = parse_config(router_config(docs), env={}).routing.goodput
    assert (g.ttft_seconds, g.ttft_seconds_per_kilo_token, g.itl_seconds, g.window_seconds) == (2.5, 0, 0.05, 30)
    seed = g.seed
    assert (seed.prefill_tokens_per_second, seed.decode_step_seconds, seed.handoff_seconds) == (1e6, 5e-05, 0.002)
    assert (seed.chunk_tokens, seed.crowding) == (8192, 2.1)


def test_decode_pods_reach_each_others_kv_ports_as_split_decoders_reach_the_prefillers(h4: Path) -> None:
    """The side channel and, with UCX over TCP, the ephemeral range: from the other decode pods,
    as split opens them from the other role, and no wider; the router reaches the API and events."""
    sets = ("networkPolicy.egress.enabled=true",)
    flexible, split = helm.render(h4, sets=(*FLEXIBLE, *sets)), helm.render(h4, sets=sets)
    pods = _pod_labels(flexible)
    decode = helm.one(flexible, "NetworkPolicy", "-decode")
    assert _allowed_from(decode, 5600, pods) == {"decode"}
    assert _allowed_from(decode, 40000, pods) == {"decode"}  # UCX over TCP (no EFA)

    def rules(docs: list[dict[str, Any]], direction: str, peer: str) -> list[dict[str, Any]]:
        """The ports of a decode policy's rules with the given peer role, peers left out."""
        key = "from" if direction == "ingress" else "to"
        return [
            r["ports"]
            for r in helm.one(docs, "NetworkPolicy", "-decode")["spec"][direction]
            if any(
                p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == peer
                for p in r.get(key, [])
            )
        ]

    for direction in ("ingress", "egress"):
        assert rules(flexible, direction, "decode") == rules(split, direction, "prefill"), direction
        assert rules(flexible, direction, "decode")  # not vacuous
        assert rules(split, direction, "decode") == []  # split: no decode-to-decode rule
    router_egress = {
        r["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: {p["port"] for p in r["ports"]}
        for r in helm.one(flexible, "NetworkPolicy", "-router")["spec"]["egress"]
        if r["to"][0].get("podSelector") and "namespaceSelector" not in r["to"][0]
    }
    assert router_egress == {"decode": {8000, 5557, 5558}}
    # EFA (LIBFABRIC): the side channel alone, as in split
    docs = helm.render(h4, SCENARIO, sets)
    ports = [p for r in helm.one(docs, "NetworkPolicy", "-decode")["spec"]["ingress"] for p in r["ports"]]
    assert not [p for p in ports if "endPort" in p]
    decode, pods = helm.one(docs, "NetworkPolicy", "-decode"), _pod_labels(docs)
    assert _allowed_from(decode, 5600, pods) == {"decode"}
    for port in (8000, 5557, 5558):  # the API and the KV-cache events: the router's alone
        assert _allowed_from(decode, port, pods) == {"router"}, port


def test_decoders_share_one_zone_among_themselves(h4: Path) -> None:
    docs = helm.render(h4, SCENARIO)
    selector = helm.one(docs, "StatefulSet", "-decode")["spec"]["selector"]["matchLabels"]
    terms = pod_spec(docs, "StatefulSet", "-decode")["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms == [{"topologyKey": ZONE, "labelSelector": {"matchLabels": selector}}]
    assert _selects({"matchLabels": selector}, _pod_labels(docs)["decode"])
    # a pinned zone instead of pod affinity, as in split
    pinned = helm.render(h4, SCENARIO, ("placement.zone=us-east-2b",))
    spec = pod_spec(pinned, "StatefulSet", "-decode")
    assert spec["nodeSelector"][ZONE] == "us-east-2b" and "affinity" not in spec
    assert "affinity" not in pod_spec(
        helm.render(h4, SCENARIO, ("placement.sameZone=false", "efa.enabled=false")), "StatefulSet", "-decode"
    )


def test_the_kv_revision_is_what_the_decode_engines_run(h4: Path) -> None:
    def revision(files: tuple[str, ...], sets: tuple[str, ...] = ()) -> str:
        docs = helm.render(h4, files, sets)
        return helm.one(docs, "StatefulSet", "-decode")["spec"]["template"]["metadata"]["labels"][
            "pd-inference.io/kv-revision"
        ]

    base = revision(SCENARIO)
    assert base == revision(SCENARIO, ("prefill.extraArgs[0]=--kv-cache-dtype=fp8",))  # not rendered, not counted
    assert base != revision(SCENARIO, ("decode.extraArgs[0]=--kv-cache-dtype=fp8",))
    assert base != revision(LAYERINGS["env:dev"])  # the switch from split is a new revision
    served = container(helm.render(h4, SCENARIO), "decode")["args"]
    assert f"qwen3.5-9b@kv-{base}" in served


def test_no_alert_waits_on_a_prefill_pool_that_is_not_there(h4: Path) -> None:
    monitoring = (
        "metrics.podMonitor.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
    )

    def alerts(files: tuple[str, ...], sets: tuple[str, ...]) -> dict[str, str]:
        rule = helm.one(helm.render(h4, files, (*monitoring, *sets)), "PrometheusRule")
        return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}

    split = alerts((), ())
    flexible = alerts(SCENARIO, ())
    # no prefill pool: no pool="prefill" series to watch; goodput records no prefill_busy decision
    assert set(split) - set(flexible) == {"PDInferenceNoHealthyPrefiller", "PDInferencePrefillPoolSaturated"}
    assert "PDInferenceNoHealthyPrefiller" not in alerts((), FLEXIBLE)
    assert "PDInferencePrefillPoolSaturated" in alerts((), FLEXIBLE)  # prefix decision: its reasons stand
    assert "PDInferencePrefillPoolSaturated" not in alerts((), GOODPUT)
    assert not [a for a, e in flexible.items() if 'pool="prefill"' in e or 'component="prefill"' in e]
    # the KV hand-off alerts watch the decode engines, which receive the KV in either layout
    assert 'component="decode"' in flexible["PDInferenceKVTransferStalled"]
