from __future__ import annotations

from pathlib import Path

import pytest

from pd_router.config import ConfigError, load_config, parse_config
from pd_router_dev.devstack import DEMO_CONFIG

ROUTER_DIR = Path(__file__).resolve().parents[1]

CONTRACT = """
listen: {host: "0.0.0.0", port: 8000}
model:
  servedName: "llama-3.3-70b"
  tokenizer: ""
routing:
  connector: lmcache
  threshold: 1024
  sessionAffinityHeader: ""
pools:
  prefill:
    discovery: dns
    static: []
    dns: {name: "pd-pd-inference-prefill.ns.svc.cluster.local", port: 8000, refreshSeconds: 10}
  decode:
    discovery: dns
    static: []
    dns: {name: "pd-pd-inference-decode.ns.svc.cluster.local", port: 8000, refreshSeconds: 10}
lmcache:
  notifyBindHost: "0.0.0.0"
  notifyPort: 7500
  notificationsPerRequest: 1
  decoderInitPorts: [7300]
  decoderAllocPorts: [7400]
  notifyTimeoutSeconds: 30
timeouts: {connectSeconds: 5, prefillSeconds: 300, firstByteSeconds: 300, streamIdleSeconds: 120}
health: {path: /health, intervalSeconds: 5, timeoutSeconds: 2, healthyThreshold: 1,
         unhealthyThreshold: 3, passiveFailureThreshold: 3}
limits: {maxInFlight: 512, maxQueued: 1024, queueTimeoutSeconds: 30, maxBodyBytes: 10485760}
auth: {apiKeysFile: "", protectMetrics: false}
logging: {level: info, logPrompts: false}
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_contract_file_loads(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, CONTRACT))
    assert cfg.routing.connector == "lmcache"
    assert cfg.pools.decode.dns.name.startswith("pd-pd-inference-decode")
    assert cfg.lmcache.decoder_init_ports == [7300]
    assert cfg.timeouts.stream_idle_seconds == 120.0
    assert cfg.limits.max_body_bytes == 10485760


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_an_empty_file_is_refused(tmp_path: Path, text: str) -> None:
    """An empty or mis-mounted file must not start a router on all defaults without a word."""
    with pytest.raises(ConfigError, match="is empty"):
        load_config(_write(tmp_path, text))


def test_an_empty_mapping_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "{}\n"))
    assert cfg.routing.threshold == 1024
    assert cfg.listen.port == 8000
    assert (cfg.timeouts.client_idle_seconds, cfg.timeouts.client_header_seconds) == (60, 10)


@pytest.mark.parametrize("path", [ROUTER_DIR / "config.example.yaml", DEMO_CONFIG])
def test_shipped_configs_load(path: Path) -> None:
    load_config(path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("routing: {treshold: 5}", "routing.treshold"),
        ("pools: {decode: {dns: {nmae: x}}}", "pools.decode.dns.nmae"),
        ("bogus: 1", "bogus"),
        ("routing: {threshold: 'many'}", "routing.threshold"),
        ("routing: {threshold: true}", "routing.threshold"),
        ("routing: {threshold: -1}", "routing.threshold"),
        ("routing: {connector: mooncake}", "routing.connector"),
        ("listen: {port: 70000}", "listen.port"),
        ("listen: 5", "listen"),
        ("auth: {protectMetrics: 'yes'}", "auth.protectMetrics"),
        ("lmcache: {decoderInitPorts: [7300, 7301]}", "lmcache.decoderAllocPorts"),
        ("lmcache: {decoderAllocPorts: ['x']}", "lmcache.decoderAllocPorts[0]"),
        ("pools: {prefill: {discovery: static}}", "pools.prefill.static"),
        ("pools: {prefill: {discovery: static, static: ['ftp://x']}}", "pools.prefill.static[0]"),
        ("timeouts: {connectSeconds: 0}", "timeouts.connectSeconds"),
        ("logging: {level: loud}", "logging.level"),
        ("health: {path: health}", "health.path"),
        ("health: {stallSeconds: -1}", "health.stallSeconds"),
        ("health: {stallSeconds: .nan}", "health.stallSeconds"),
        ("timeouts: {firstByteSeconds: .nan}", "timeouts.firstByteSeconds"),
        ("timeouts: {clientBodySeconds: .inf}", "timeouts.clientBodySeconds"),
        ("timeouts: {clientIdleSeconds: 0}", "timeouts.clientIdleSeconds"),
        ("timeouts: {clientIdleSeconds: .inf}", "timeouts.clientIdleSeconds"),
        ("timeouts: {clientHeaderSeconds: -1}", "timeouts.clientHeaderSeconds"),
        ("timeouts: {clientHeaderSeconds: .nan}", "timeouts.clientHeaderSeconds"),
        ("timeouts: {clientHeaderSeconds: 'soon'}", "timeouts.clientHeaderSeconds"),
        ("limits: {queueTimeoutSeconds: .nan}", "limits.queueTimeoutSeconds"),
        ("model: {adapters: 'sql'}", "model.adapters"),
        ("model: {adapters: [7]}", "model.adapters[0]"),
        ("model: {adapters: ['a=b']}", "model.adapters[0]"),
        ("model: {adapters: ['x@kv-0123456789']}", "model.adapters[0]"),
        ("model: {servedName: m, adapters: [m]}", "model.adapters[0]"),
        ("model: {adapters: [a, b, a]}", "model.adapters[2]"),
        ("{model: {adapters: [a]}, routing: {connector: lmcache}}", "model.adapters"),
        ("remoteModels: {name: b}", "remoteModels"),
        ("remoteModels: [{name: b, url: 'http://b:8000', port: 1}]", "remoteModels[0].port"),
        ("remoteModels: [{url: 'http://b:8000'}]", "remoteModels[0].name"),
        ("remoteModels: [{name: 'b@kv-0123456789', url: 'http://b:8000'}]", "remoteModels[0].name"),
        ("remoteModels: [{name: b}]", "remoteModels[0].url"),
        ("remoteModels: [{name: b, url: 'b:8000'}]", "remoteModels[0].url"),
        ("remoteModels: [{name: b, url: 'http://b:8000/v1'}]", "remoteModels[0].url"),
        (
            "{model: {servedName: m}, remoteModels: [{name: m, url: 'http://b:1'}]}",
            "remoteModels[0].name",
        ),
        (
            "{model: {adapters: [a]}, remoteModels: [{name: a, url: 'http://b:1'}]}",
            "remoteModels[0].name",
        ),
        (
            "remoteModels: [{name: b, url: 'http://b:1'}, {name: b, url: 'http://c:1'}]",
            "remoteModels[1].name",
        ),
    ],
)
def test_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, text))
    assert str(exc.value).startswith(field + ":"), str(exc.value)


def test_env_overrides(tmp_path: Path) -> None:
    p = _write(tmp_path, CONTRACT)
    env = {
        "PD_ROUTER__ROUTING__THRESHOLD": "0",
        "PD_ROUTER__ROUTING__CONNECTOR": "nixl",
        "PD_ROUTER__POOLS__DECODE__DISCOVERY": "static",
        "PD_ROUTER__POOLS__DECODE__STATIC": "[http://10.0.0.1:8000]",
        "PD_ROUTER__LMCACHE__DECODERINITPORTS": "[1, 2]",
        "PD_ROUTER__LMCACHE__DECODERALLOCPORTS": "[3, 4]",
        "UNRELATED": "x",
    }
    cfg = load_config(p, env)
    assert cfg.routing.threshold == 0
    assert cfg.routing.connector == "nixl"
    assert cfg.pools.decode.static == ["http://10.0.0.1:8000"]
    assert cfg.lmcache.decoder_alloc_ports == [3, 4]


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"PD_ROUTER__ROUTING__THRESHOLD": "abc"}, "routing.threshold"),
        ({"PD_ROUTER__TIMEOUTS__PREFILLSECONDS": ".nan"}, "timeouts.prefillSeconds"),
        ({"PD_ROUTER__ROUTING__NOPE": "1"}, "routing.nope"),
        ({"PD_ROUTER__ROUTING__THRESHOLD__X": "1"}, "routing.threshold"),
    ],
)
def test_env_errors_name_the_field(tmp_path: Path, env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, CONTRACT), env)
    assert str(exc.value).startswith(field + ":"), str(exc.value)


def test_unreadable_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError):
        parse_config([1, 2])
