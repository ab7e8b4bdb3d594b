"""Every port is defined once (values `ports`, read by the one port model in templates/_ports.tpl)
and agrees across the router config, containers, Services, NetworkPolicies and LMCache configs;
NetworkPolicies select the pods they protect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import helm, manifests
from tests.cases import LAYERINGS, LMCACHE
from tests.manifests import (
    container,
    container_ports,
    kv_transfer_config,
    lmcache_config,
    policy_ports,
    router_config,
    service_ports,
)

CUSTOM_PORTS = (
    "ports.engineHttp=8100",
    "ports.routerHttp=8200",
    "ports.lmcacheInitBase=9300",
    "ports.lmcacheAllocBase=9400",
    "ports.proxyNotification=9500",
    "ports.nixlSideChannel=9600",
    "ports.kvEvents=9800",
    "ports.kvEventsReplay=9801",
    "ports.lmcacheMpServer=9900",
    "ports.lmcacheMpHttp=9901",
    "prefill.tensorParallelSize=2",
    "decode.tensorParallelSize=2",
)


def test_lmcache_ports_agree_everywhere(h4: Path) -> None:
    docs = helm.render(h4, (LMCACHE,), sets=CUSTOM_PORTS)
    init, alloc = [9300, 9301], [9400, 9401]
    rc = router_config(docs)
    assert rc["listen"]["port"] == 8200
    assert rc["pools"]["prefill"]["dns"]["port"] == rc["pools"]["decode"]["dns"]["port"] == 8100
    assert rc["lmcache"]["notifyPort"] == 9500
    assert rc["lmcache"]["decoderInitPorts"] == init and rc["lmcache"]["decoderAllocPorts"] == alloc
    assert rc["lmcache"]["notificationsPerRequest"] == 2
    assert (rc["routing"]["kvEvents"]["port"], rc["routing"]["kvEvents"]["replayPort"]) == (9800, 9801)
    # LMCache configs
    assert lmcache_config(docs, "decode")["pd_peer_init_port"] == init
    assert lmcache_config(docs, "decode")["pd_peer_alloc_port"] == alloc
    assert lmcache_config(docs, "prefill")["pd_proxy_port"] == 9500
    # Containers and Services
    assert container_ports(docs, "Deployment", "-router") == {"http": 8200, "pd-notify": 9500}
    assert service_ports(docs, "-router") == {"http": 8000, "pd-notify": 9500}
    decode_ports = {"http": 8100, "lmc-init-0": 9300, "lmc-alloc-0": 9400, "lmc-init-1": 9301, "lmc-alloc-1": 9401}
    # the KV-cache event ports: on the containers, not the Services (the router connects to pod IPs)
    events = {"kv-events": 9800, "kv-replay": 9801}
    assert container_ports(docs, "StatefulSet", "-decode") == {**decode_ports, **events}
    assert service_ports(docs, "-decode") == decode_ports
    assert container_ports(docs, "StatefulSet", "-prefill") == {"http": 8100, **events}
    assert service_ports(docs, "-prefill") == {"http": 8100}
    # NetworkPolicies
    assert policy_ports(docs, "-router") == {8200, 9500}
    assert policy_ports(docs, "-decode") == {8100, 9800, 9801, *init, *alloc}
    assert policy_ports(docs, "-prefill") == {8100, 9800, 9801}
    # Probes use the named port.
    assert container(docs, "decode")["readinessProbe"]["httpGet"]["port"] == "http"
    assert "--port=8100" in container(docs, "decode")["args"]


def test_nixl_ports_agree_everywhere(h4: Path) -> None:
    docs = helm.render(h4, sets=CUSTOM_PORTS + ("kvTransfer.connector=nixl",))
    for role in ("prefill", "decode"):
        events = {"kv-events": 9800, "kv-replay": 9801}
        assert container_ports(docs, "StatefulSet", f"-{role}") == {"http": 8100, **events, "nixl-side": 9600}
        assert service_ports(docs, f"-{role}") == {"http": 8100, "nixl-side": 9600}
        assert policy_ports(docs, f"-{role}") == {8100, 9800, 9801, 9600}
        env = {e["name"]: e.get("value") for e in container(docs, role)["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9600"
    assert container_ports(docs, "Deployment", "-router") == {"http": 8200}
    assert policy_ports(docs, "-router") == {8200}


def test_lmcache_mp_ports_agree_everywhere_and_stay_in_the_pod(h4: Path) -> None:
    """kvTransfer.nixl.lmcacheMp: the engine's connector and its pod's server on the same port,
    both of the server's ports on 127.0.0.1, on no container, Service or NetworkPolicy."""
    sets = CUSTOM_PORTS + ("kvTransfer.nixl.lmcacheMp.enabled=true", "model.attention=full")
    docs = helm.render(h4, sets=sets)
    for role in ("prefill", "decode"):
        kv = kv_transfer_config(docs, role)
        (lmc,) = [c for c in kv["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "LMCacheMPConnector"]
        assert (
            lmc["kv_connector_extra_config"]["lmcache.mp.host"],
            lmc["kv_connector_extra_config"]["lmcache.mp.port"],
        ) == ("tcp://127.0.0.1", 9900)
        pod = helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]
        (server,) = [c for c in pod["containers"] if c["name"] == "lmcache-server"]
        assert {"--host=127.0.0.1", "--port=9900", "--http-host=127.0.0.1", "--http-port=9901"} <= set(server["args"])
        assert "ports" not in server and "127.0.0.1:9901/" in server["livenessProbe"]["exec"]["command"][-1]
        assert service_ports(docs, f"-{role}") == {"http": 8100, "nixl-side": 9600}
        assert policy_ports(docs, f"-{role}") == {8100, 9800, 9801, 9600}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each component's pod labels: the router's, each role's serving pods' (a multi-node role's
    leaders; its workers as "<role>-worker"), the helm test pod's."""
    pods = {"router": helm.one(docs, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]}
    for role in manifests.engine_roles(docs):
        for member, template in manifests.engine_templates(docs, role).items():
            pods[role if member != "worker" else f"{role}-worker"] = template["metadata"]["labels"]
    pods["helm-test"] = helm.one(docs, "Pod", "-helm-test")["metadata"]["labels"]
    return pods


@pytest.mark.parametrize("name", LAYERINGS)
def test_network_policies_select_the_pods_they_protect(h4: Path, name: str) -> None:
    docs = helm.render(h4, LAYERINGS[name])
    pods = _pod_labels(docs)
    for component in ("router", *manifests.engine_roles(docs)):
        policy = helm.one(docs, "NetworkPolicy", f"-{component}")
        selected = {c for c, labels in pods.items() if _selects(policy["spec"]["podSelector"], labels)}
        assert selected == {c for c in pods if c.removesuffix("-worker") == component}  # a group's workers too
        # Every workload Service selects exactly its own pods.
        svc = helm.one(docs, "Service", f"-{component}")
        assert {c for c, labels in pods.items() if _selects({"matchLabels": svc["spec"]["selector"]}, labels)} == {
            component
        }


def _allowed_from(policy: dict[str, Any], port: int, pods: dict[str, dict[str, str]]) -> set[str]:
    allowed: set[str] = set()
    for rule in policy["spec"]["ingress"]:
        if not any(p["port"] == port or p.get("endPort", 0) >= port >= p["port"] for p in rule["ports"]):
            continue
        if "from" not in rule:
            return {"anyone"}
        for peer in rule["from"]:
            if "podSelector" in peer and "namespaceSelector" not in peer:
                allowed |= {c for c, labels in pods.items() if _selects(peer["podSelector"], labels)}
            else:
                allowed.add("external")
    return allowed


def test_engines_accept_http_from_router_and_kv_from_other_role(h4: Path) -> None:
    docs = helm.render(h4, (LMCACHE,), sets=("networkPolicy.allowEphemeralKvPorts=false",))
    pods = _pod_labels(docs)
    decode, prefill = helm.one(docs, "NetworkPolicy", "-decode"), helm.one(docs, "NetworkPolicy", "-prefill")
    assert _allowed_from(decode, 8000, pods) == {"router"}
    assert _allowed_from(prefill, 8000, pods) == {"router"}
    assert _allowed_from(decode, 7300, pods) == {"prefill"}
    assert _allowed_from(decode, 7400, pods) == {"prefill"}
    assert _allowed_from(prefill, 7300, pods) == set()
    router = helm.one(docs, "NetworkPolicy", "-router")
    assert _allowed_from(router, 7500, pods) == {"prefill"}
    assert _allowed_from(router, 8000, pods) == {"anyone"}


def test_router_ingress_can_be_restricted_and_helm_test_still_reaches_it(h4: Path) -> None:
    docs = helm.render(h4, ("values/prod.yaml",))
    router = helm.one(docs, "NetworkPolicy", "-router")
    assert _allowed_from(router, 8000, _pod_labels(docs)) == {"helm-test", "external"}


def test_ephemeral_kv_ports_only_from_the_other_role(h4: Path) -> None:
    docs = helm.render(h4)
    pods = _pod_labels(docs)
    assert _allowed_from(helm.one(docs, "NetworkPolicy", "-decode"), 40000, pods) == {"prefill"}
    assert _allowed_from(helm.one(docs, "NetworkPolicy", "-prefill"), 40000, pods) == {"decode"}


def test_network_policies_can_be_turned_off(h4: Path) -> None:
    assert not helm.find(helm.render(h4, sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


def test_notification_sidecar_ports_agree_everywhere(h4: Path) -> None:
    docs = helm.render(
        h4,
        (LMCACHE,),
        sets=(
            *CUSTOM_PORTS,
            "ports.notificationSidecar=9700",
            "kvTransfer.lmcache.notificationReceiver=prefillSidecar",
            "networkPolicy.allowEphemeralKvPorts=false",
        ),
    )
    rc = router_config(docs)
    assert rc["lmcache"]["notificationReceiver"] == "prefillSidecar" and rc["lmcache"]["sidecarPort"] == 9700
    # The router no longer receives notifications: no port, no policy rule for them.
    assert container_ports(docs, "Deployment", "-router") == {"http": 8200}
    assert service_ports(docs, "-router") == {"http": 8000}
    assert policy_ports(docs, "-router") == {8200}
    prefill = helm.one(docs, "StatefulSet", "-prefill")["spec"]["template"]["spec"]
    sidecar = next(c for c in prefill["containers"] if c["name"] == "notify-sidecar")
    assert sidecar["ports"] == [{"name": "notify-sidecar", "containerPort": 9700, "protocol": "TCP"}]
    assert "--port=9700" in sidecar["args"] and "--zmq-bind=tcp://127.0.0.1:9500" in sidecar["args"]
    assert lmcache_config(docs, "prefill")["pd_proxy_port"] == 9500
    assert service_ports(docs, "-prefill") == {"http": 8100, "notify-sidecar": 9700}
    assert policy_ports(docs, "-prefill") == {8100, 9800, 9801, 9700}
    pods = _pod_labels(docs)
    assert _allowed_from(helm.one(docs, "NetworkPolicy", "-prefill"), 9700, pods) == {"router"}
    # Decoders never run it.
    decode = helm.one(docs, "StatefulSet", "-decode")["spec"]["template"]["spec"]
    assert [c["name"] for c in decode["containers"]] == ["vllm", "metrics-proxy"]  # no notification sidecar


def _ephemeral(docs: list[dict]) -> list[dict]:
    return [
        p for d in helm.find(docs, "NetworkPolicy") for r in d["spec"]["ingress"] for p in r["ports"] if "endPort" in p
    ]


def test_ephemeral_kv_ports_only_where_ucx_moves_the_kv_over_tcp(h4: Path) -> None:
    assert _ephemeral(helm.render(h4))  # no EFA: UCX over TCP
    assert not _ephemeral(helm.render(h4, sets=("efa.enabled=true", "efa.devices=1")))  # LIBFABRIC over EFA
    assert not _ephemeral(helm.render(h4, sets=("networkPolicy.allowEphemeralKvPorts=false",)))
    for env in ("env:dev", "env:staging", "env:prod"):  # all on EFA profiles
        assert not _ephemeral(helm.render(h4, LAYERINGS[env])), env


def test_egress_policies_allow_only_dns_the_peers_and_the_hub(h4: Path) -> None:
    import kubernetes_validate

    assert all("Egress" not in d["spec"]["policyTypes"] for d in helm.find(helm.render(h4), "NetworkPolicy"))
    hub = "networkPolicy.egress.hubTo[0].ipBlock.cidr=10.9.0.0/16"
    docs = helm.render(h4, sets=("networkPolicy.egress.enabled=true", hub, "model.routerTokenizerFromHub=true"))
    policies = {d["metadata"]["name"].rsplit("-", 1)[1]: d for d in helm.find(docs, "NetworkPolicy")}
    assert set(policies) == {"prefill", "decode", "router"}
    for name, pol in policies.items():
        kubernetes_validate.validate(pol, helm.KUBE_VERSION, strict=True)
        assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"]
        egress = pol["spec"]["egress"]
        assert {p["port"] for p in egress[0]["ports"]} == {53}  # DNS first
        assert any(
            r["to"] == [{"ipBlock": {"cidr": "10.9.0.0/16"}}] and r["ports"] == [{"port": 443, "protocol": "TCP"}]
            for r in egress
        ), name
        for rule in egress[1:]:
            assert rule["to"], name  # never an empty (any-destination) peer list
    prefill_peers = [r for r in policies["prefill"]["spec"]["egress"][1:] if r["to"][0].get("podSelector")]
    assert prefill_peers[0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    assert {p["port"] for p in prefill_peers[0]["ports"]} >= {5600}
    router_peers = {
        r["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for r in policies["router"]["spec"]["egress"][1:]
        if r["to"][0].get("podSelector")
    }
    assert router_peers == {"prefill", "decode"}
    # without hubTo no rule reaches outside the release
    docs = helm.render(h4, sets=("networkPolicy.egress.enabled=true",))
    for pol in helm.find(docs, "NetworkPolicy"):
        assert all("ipBlock" not in peer for r in pol["spec"]["egress"] for peer in r["to"])


def test_prometheus_reaches_the_engines_metrics_proxy_and_not_their_api(h4: Path) -> None:
    monitoring = "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring"
    docs = helm.render(h4, sets=(monitoring, "metrics.podMonitor.enabled=true"))
    peer = {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}
    for role in ("prefill", "decode"):
        pol = helm.one(docs, "NetworkPolicy", f"-{role}")
        reach = {p["port"] for r in pol["spec"]["ingress"] if peer in r.get("from", []) for p in r["ports"]}
        assert reach == {8001}, (role, reach)  # ports.engineMetrics only, never ports.engineHttp
        pod = helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]
        (proxy,) = [c for c in pod["containers"] if c["name"] == "metrics-proxy"]
        assert "--upstream=http://127.0.0.1:8000" in proxy["args"] and proxy["ports"][0]["name"] == "metrics"
    assert helm.one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # without the proxy the monitor scrapes the API port, which metricsFrom must then reach
    docs = helm.render(h4, sets=(monitoring, "metrics.podMonitor.enabled=true", "engine.metricsProxy.enabled=false"))
    pol = helm.one(docs, "NetworkPolicy", "-decode")
    assert {p["port"] for r in pol["spec"]["ingress"] if peer in r.get("from", []) for p in r["ports"]} == {8000}
    assert helm.one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "http"


def test_egress_opens_only_ports_the_peer_listens_on(h4: Path) -> None:
    """Egress is derived from the port model: to each peer, the ports of it that name this pod as a
    source. The decoders push nothing to the prefillers with LMCache, so their egress to them opens
    no LMCache receiver port (only the ephemeral UCX ports over TCP)."""
    docs = helm.render(h4, (LMCACHE,), sets=("networkPolicy.egress.enabled=true",))
    pods = _pod_labels(docs)

    def egress(component: str) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for rule in helm.one(docs, "NetworkPolicy", f"-{component}")["spec"]["egress"]:
            for peer in rule["to"]:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    for c, labels in pods.items():
                        if _selects(peer["podSelector"], labels):
                            out.setdefault(c, set()).update(p["port"] for p in rule["ports"])
        return out

    assert egress("prefill") == {"decode": {7300, 7400, 1024}, "router": {7500}}
    assert egress("decode") == {"prefill": {1024}}
    assert egress("router") == {"prefill": {8000, 5557, 5558}, "decode": {8000, 5557, 5558}}  # API, KV events
    docs = helm.render(h4, (LMCACHE,), sets=("networkPolicy.egress.enabled=true", "efa.enabled=true", "efa.devices=1"))
    decode = helm.one(docs, "NetworkPolicy", "-decode")["spec"]["egress"]
    assert not any(r["to"][0].get("podSelector") for r in decode[1:]), decode  # EFA: nothing to reach


@pytest.mark.parametrize(
    "base,sets,expected",
    [
        # the ports of the connector not in use are checked too, so switching it later cannot collide
        ((), ("ports.proxyNotification=8000",), ("ports.routerHttp", "ports.proxyNotification", "connector lmcache")),
        ((), ("ports.lmcacheAllocBase=8001",), ("ports.engineMetrics", "ports.lmcacheAllocBase", "decode pods")),
        # the metrics proxy's port, even while the proxy is off
        (
            (),
            ("engine.metricsProxy.enabled=false", "ports.engineMetrics=8000"),
            ("ports.engineHttp", "ports.engineMetrics"),
        ),
        # the KV-cache event ports, even while the events are off
        ((), ("ports.kvEventsReplay=5600",), ("ports.kvEventsReplay", "ports.nixlSideChannel", "prefill pods")),
        (
            (LMCACHE,),
            ("engine.kvEvents.enabled=false", "ports.kvEvents=7300"),
            ("ports.kvEvents", "ports.lmcacheInitBase", "decode pods"),
        ),
        # LMCache's MP server's ports, even while it is off
        ((), ("ports.lmcacheMpHttp=5557",), ("ports.kvEvents", "ports.lmcacheMpHttp", "prefill pods")),
        # the notification sidecar binds ports.proxyNotification on 127.0.0.1 in the prefill pod
        (
            (LMCACHE,),
            ("kvTransfer.lmcache.notificationReceiver=prefillSidecar", "ports.proxyNotification=8000"),
            ("ports.engineHttp", "ports.proxyNotification", "prefill pods"),
        ),
    ],
)
def test_port_collisions_are_refused_naming_both_values(
    h4: Path, base: tuple[str, ...], sets: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    result = helm.template(h4, base, sets=sets)
    assert result.returncode != 0, result.stdout[:300]
    for text in expected:
        assert text in result.stderr, (text, result.stderr)


def test_ports_of_distinct_pods_may_repeat(h4: Path) -> None:
    """A collision is two ports of ONE pod: the router's and the engines' HTTP ports may be equal
    (the default), and so may ports of modes that never run together."""
    assert helm.template(h4, sets=("ports.notificationSidecar=5600",)).returncode == 0  # sidecar: LMCache only
    # NIXL's side channel and LMCache's receiver ports: one connector or the other, never both
    assert helm.template(h4, sets=("ports.lmcacheInitBase=5600",)).returncode == 0
    assert helm.template(h4, (LMCACHE,), sets=("ports.nixlSideChannel=7400",)).returncode == 0
    sidecar = ("kvTransfer.lmcache.notificationReceiver=prefillSidecar", "ports.lmcacheInitBase=7600")
    assert helm.template(h4, (LMCACHE,), sets=sidecar).returncode == 0  # decoders vs the prefill pods


def test_every_declared_port_is_in_the_service_or_policy_it_belongs_to(h4: Path) -> None:
    """Across every layering: each Service port targets a port its pods declare, and each
    ingress port of a policy is one its pods declare (or the UCX range)."""
    for name, files in LAYERINGS.items():
        docs = helm.render(h4, files, sets=("networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prom",))
        for component in ("router", *manifests.engine_roles(docs)):
            if component == "router":
                pod = helm.one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
            else:
                pod = manifests.serving_template(docs, component)["spec"]
            declared = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
            for port in helm.one(docs, "Service", f"-{component}")["spec"]["ports"]:
                assert port["targetPort"] in declared, (name, component, port)
            opened = {
                p["port"]
                for r in helm.one(docs, "NetworkPolicy", f"-{component}")["spec"]["ingress"]
                for p in r["ports"]
                if "endPort" not in p
            }
            assert opened <= set(declared.values()), (name, component, opened, declared)
