"""The chart's tracing values (templates/_tracing.tpl) and Gateway API / Ingress entry points,
rendered: what the router, the engines and the NetworkPolicies get, checked with the router's
own config loader and tracing module. vLLM's parser reads the rendered engine flags in
tests/engines/ (scenario:tracing-gateway); the real API server validates the objects in
tests/cluster/test_admission.py; a real collector receives the spans in router/tests/
test_router_tracing.py and tests/real_engine/test_real_tracing.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pd_router.config import load_config
from pd_router.tracing import TRACES_PATH

from tests import helm
from tests.cases import LAYERINGS

TRACED = LAYERINGS["scenario:tracing-gateway"]


def _router_config(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    path = tmp_path / "router.yaml"
    path.write_text(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])
    return load_config(path, env={})


def _engine(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize(
    ("protocol", "endpoint", "engine_url"),
    [
        ("grpc", "http://otel.observability:4317", "http://otel.observability:4317"),
        ("http/protobuf", "https://otlp.vendor.example/otlp/", "https://otlp.vendor.example/otlp/v1/traces"),
    ],
)
def test_router_and_engines_export_to_one_endpoint(
    h4: Path, tmp_path: Path, protocol: str, endpoint: str, engine_url: str
) -> None:
    values = f"tracing: {{endpoint: '{endpoint}', protocol: {protocol}, samplingRatio: 0.5}}\n"
    docs = helm.render(h4, values_yaml=values)
    cfg = _router_config(docs, tmp_path).tracing
    assert (cfg.endpoint, cfg.protocol, cfg.sampling_ratio) == (endpoint, protocol, 0.5)
    assert cfg.service_name == "pd-pd-inference-router"
    # the URL vLLM's exporter gets is the one the router's exporter posts to
    router_url = cfg.endpoint if protocol == "grpc" else cfg.endpoint.rstrip("/") + TRACES_PATH
    for role in ("prefill", "decode"):
        c = _engine(docs, role)
        assert f"--otlp-traces-endpoint={router_url}" in c["args"]
        assert f"--otlp-traces-endpoint={engine_url}" in c["args"]
        env = _env(c)
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == protocol
        assert env["OTEL_SERVICE_NAME"] == f"pd-pd-inference-{role}"
        assert (env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.5")
        assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")  # $(POD_NAME) resolves
        assert "OTEL_EXPORTER_OTLP_TRACES_HEADERS" not in env


def test_headers_come_from_the_secret_only(h4: Path, tmp_path: Path) -> None:
    docs = helm.render(h4, TRACED)
    cfg = _router_config(docs, tmp_path).tracing
    router = helm.one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    mount = next(m for m in router["containers"][0]["volumeMounts"] if m["name"] == "otlp-headers")
    volume = next(v for v in router["volumes"] if v["name"] == "otlp-headers")
    assert cfg.headers_file == f"{mount['mountPath']}/headers"
    assert volume["secret"]["secretName"] == "otlp-headers" and mount["readOnly"]
    for role in ("prefill", "decode"):
        ref = _env(_engine(docs, role))["OTEL_EXPORTER_OTLP_TRACES_HEADERS"]
        assert ref == {"secretKeyRef": {"name": "otlp-headers", "key": "headers"}}
    assert "--collect-detailed-traces=model" in _engine(docs, "decode")["args"]


def test_egress_reaches_the_collector_on_its_port_only_from_tracing_pods(h4: Path) -> None:
    docs = helm.render(h4, TRACED)
    peer = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}]
    for name in ("-router", "-prefill", "-decode"):
        rules = helm.one(docs, "NetworkPolicy", name)["spec"]["egress"]
        assert {"to": peer, "ports": [{"port": 4318, "protocol": "TCP"}]} in rules, name
    off = helm.render(h4, TRACED, sets=("tracing.engines.enabled=false", "tracing.engines.detailedTraces="))
    for name in ("-prefill", "-decode"):
        rules = helm.one(off, "NetworkPolicy", name)["spec"]["egress"]
        assert all(r.get("to") != peer for r in rules), name
    https = helm.render(h4, TRACED, sets=("tracing.endpoint=https://otlp.vendor.example",))
    rules = helm.one(https, "NetworkPolicy", "-router")["spec"]["egress"]
    assert {"to": peer, "ports": [{"port": 443, "protocol": "TCP"}]} in rules


def test_router_only_tracing_leaves_the_engine_pods_alone(h4: Path) -> None:
    """Turning the router's tracing on, engines off, changes no engine pod (they would restart
    and reload their model)."""
    plain = helm.render(h4)
    traced = helm.render(h4, sets=("tracing.endpoint=http://otel:4317", "tracing.engines.enabled=false"))
    for role in ("prefill", "decode"):
        assert helm.one(traced, "StatefulSet", f"-{role}") == helm.one(plain, "StatefulSet", f"-{role}")


def test_http_route_sends_the_openai_api_to_the_router_service(h4: Path) -> None:
    docs = helm.render(h4, TRACED)
    route = helm.one(docs, "HTTPRoute", "-router")
    service = helm.one(docs, "Service", "-router")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]  # not /metrics
    assert rule["timeouts"] == {"request": "2h", "backendRequest": "90m"}
    assert route["spec"]["parentRefs"][0]["name"] == "inference"
    ingress = helm.one(docs, "Ingress", "-router")
    (irule,) = ingress["spec"]["rules"]
    assert irule["host"] == "llm.example.com"
    (path,) = irule["http"]["paths"]
    assert path["path"] == "/v1" and path["backend"]["service"]["name"] == service["metadata"]["name"]
    assert path["backend"]["service"]["port"]["number"] == service["spec"]["ports"][0]["port"]


@pytest.mark.parametrize(
    ("request_", "backend", "ok"),
    [
        ("1h", "1h", True),
        ("0s", "5h", True),
        ("1h", "0s", True),
        ("90m", "1h30m1s", False),
        ("1h", "3601s", False),
        ("500ms", "1s", False),
    ],
)
def test_route_timeouts_are_compared_as_the_gateway_api_does(h4: Path, request_: str, backend: str, ok: bool) -> None:
    sets = (
        "router.httpRoute.enabled=true",
        "router.httpRoute.parentRefs[0].name=gw",
        f"router.httpRoute.timeouts.request={request_}",
        f"router.httpRoute.timeouts.backendRequest={backend}",
    )
    result = helm.template(h4, sets=sets)
    assert (result.returncode == 0) == ok, result.stderr
