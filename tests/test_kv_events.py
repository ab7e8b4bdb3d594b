"""vLLM's KV-cache events (engine.kvEvents): both engine roles publish them over ZMQ on the ports
of the one port model, only the router pods may connect, and the router config names the same
ports and topic; off, nothing of it is rendered but the router config's `enabled: false`. A
--kv-events-config or --no-enable-prefix-caching in a role's extraArgs, which would leave the
router subscribed to nothing, is refused naming the fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import helm
from tests.cases import LAYERINGS, LMCACHE
from tests.manifests import container, engine_roles, policy_ports, router_config, service_ports
from tests.test_ports_and_policies import _allowed_from, _pod_labels

ROLES = ("prefill", "decode")
OFF = ("engine.kvEvents.enabled=false",)
# The exact argument, compact and in this key order (templates/engine/_args.tpl).
DEFAULT_CONFIG = (
    '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
    '"replay_endpoint":"tcp://*:5558","topic":"kv"}'
)


def kv_events_args(docs: list[dict], role: str) -> list[str]:
    """The values of every --kv-events-config on a role's engine command line."""
    args = container(docs, role)["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == "--kv-events-config"] + [
        a.split("=", 1)[1] for a in args if a.startswith("--kv-events-config=")
    ]


def vllm_ports(docs: list[dict], role: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(docs, role)["ports"]}


@pytest.mark.parametrize("files", [(), (LMCACHE,)], ids=["nixl", "lmcache"])
def test_both_roles_publish_the_exact_config(h4: Path, files: tuple[str, ...]) -> None:
    docs = helm.render(h4, files)
    for role in ROLES:
        assert kv_events_args(docs, role) == [DEFAULT_CONFIG], role
        assert vllm_ports(docs, role).items() >= {"kv-events": 5557, "kv-replay": 5558}.items(), role


def test_the_ports_come_from_the_port_values(h4: Path) -> None:
    docs = helm.render(h4, sets=("ports.kvEvents=6557", "ports.kvEventsReplay=6558"))
    for role in ROLES:
        (cfg,) = kv_events_args(docs, role)
        assert cfg == DEFAULT_CONFIG.replace("5557", "6557").replace("5558", "6558")
        assert list(json.loads(cfg)) == ["enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic"]
        assert vllm_ports(docs, role).items() >= {"kv-events": 6557, "kv-replay": 6558}.items()
        # the router connects to each pod's IP (DNS of the headless Service): not Service ports
        assert not {"kv-events", "kv-replay"} & set(service_ports(docs, f"-{role}"))
        # only the vLLM container declares them
        pod = helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]
        for c in pod["containers"][1:]:
            assert not {p["name"] for p in c.get("ports", [])} & {"kv-events", "kv-replay"}, c["name"]
    rc = router_config(docs)["routing"]["kvEvents"]
    assert rc == {"enabled": True, "port": 6557, "replayPort": 6558, "topic": json.loads(cfg)["topic"]}


@pytest.mark.parametrize("egress", [False, True])
def test_only_the_router_pods_reach_the_event_ports(h4: Path, egress: bool) -> None:
    # (not the UCX-over-TCP range, which opens every port to the other role; EFA renders none)
    sets = (
        "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prom",
        "networkPolicy.allowEphemeralKvPorts=false",
    )
    docs = helm.render(h4, sets=sets + (("networkPolicy.egress.enabled=true",) if egress else ()))
    pods = _pod_labels(docs)
    for role in ROLES:
        policy = helm.one(docs, "NetworkPolicy", f"-{role}")
        for port in (5557, 5558):
            assert _allowed_from(policy, port, pods) == {"router"}, (role, port)
    if egress:
        for rule in helm.one(docs, "NetworkPolicy", "-router")["spec"]["egress"]:
            peer = rule["to"][0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            if peer in ROLES:
                assert {5557, 5558} <= {p["port"] for p in rule["ports"]}, peer
        for role in ROLES:  # the engines never reach each other's event ports
            other = "decode" if role == "prefill" else "prefill"
            for rule in helm.one(docs, "NetworkPolicy", f"-{role}")["spec"]["egress"]:
                if (
                    rule["to"][0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                    == other
                ):
                    assert not {5557, 5558} & {p["port"] for p in rule["ports"]}, role


@pytest.mark.parametrize("name", LAYERINGS)
def test_every_layering_publishes_on_every_role(h4: Path, name: str) -> None:
    docs = helm.render(h4, LAYERINGS[name])
    assert router_config(docs)["routing"]["kvEvents"]["enabled"] is True
    for role in engine_roles(docs):  # both, or the one pool of engine.layout flexible
        assert len(kv_events_args(docs, role)) == 1, (name, role)


def test_off_renders_no_flag_and_no_port(h4: Path) -> None:
    docs = helm.render(h4, sets=(*OFF, "networkPolicy.egress.enabled=true"))
    for role in ROLES:
        assert kv_events_args(docs, role) == [], role
        assert not {"kv-events", "kv-replay"} & set(vllm_ports(docs, role)), role
        assert not {5557, 5558} & policy_ports(docs, f"-{role}"), role
    router_egress = {
        p["port"] for r in helm.one(docs, "NetworkPolicy", "-router")["spec"]["egress"] for p in r["ports"]
    }
    assert not {5557, 5558} & router_egress
    assert router_config(docs)["routing"]["kvEvents"] == {
        "enabled": False,
        "port": 5557,
        "replayPort": 5558,
        "topic": "kv",
    }


def test_the_router_loader_reads_what_the_chart_renders(h4: Path, tmp_path: Path) -> None:
    from pd_router.config import load_config

    for sets, enabled in (((), True), (OFF, False)):
        path = tmp_path / "router.yaml"
        docs = helm.render(h4, sets=(*sets, "ports.kvEvents=6557", "ports.kvEventsReplay=6558"))
        path.write_text(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])
        ke = load_config(path, env={}).routing.kv_events
        assert (ke.enabled, ke.port, ke.replay_port, ke.topic) == (enabled, 6557, 6558, "kv")


REFUSED = {
    "own config, one argument": ("prefill", ["--kv-events-config={}"], "--kv-events-config"),
    "own config, two arguments": ("decode", ["--kv-events-config", "{}"], "--kv-events-config"),
    "own config, underscores": ("decode", ["--kv_events_config={}"], "--kv_events_config"),
    "own config, a dotted key": ("prefill", ["--kv-events-config.topic=other"], "--kv-events-config.topic"),
    "prefix caching off": ("decode", ["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    "prefix caching off, prefill": ("prefill", ["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_extra_args_that_silence_the_events_are_refused(any_helm: Path, name: str) -> None:
    role, args, flag = REFUSED[name]
    values = json.dumps({role: {"extraArgs": args}})
    result = helm.template(any_helm, values_yaml=values)
    assert result.returncode != 0, f"{name}: rendered"
    assert f"{role}.extraArgs: {flag}" in result.stderr, result.stderr
    assert "engine.kvEvents.enabled" in result.stderr, result.stderr
    if "prefix caching" in name:
        assert "engine.kvEvents.enabled=false" in result.stderr, result.stderr
    # off, both are the user's to set
    assert (
        helm.template(
            any_helm, values_yaml=json.dumps({**json.loads(values), "engine": {"kvEvents": {"enabled": False}}})
        ).returncode
        == 0
    )


def test_other_prefix_cache_flags_are_left_alone(h4: Path) -> None:
    """The router indexes the token ids the events carry, not vLLM's block hashes: any
    --prefix-caching-hash-algo serves it, and --enable-prefix-caching only says the default."""
    sets = ("decode.extraArgs[0]=--prefix-caching-hash-algo=sha256", "prefill.extraArgs[0]=--enable-prefix-caching")
    docs = helm.render(h4, sets=sets)
    assert kv_events_args(docs, "decode") == kv_events_args(docs, "prefill") == [DEFAULT_CONFIG]
