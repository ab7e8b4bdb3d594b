"""The router ConfigMap the chart renders is loaded by the router's own config loader, for the
defaults, every values file and every environment layering."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_router.config import ConfigError, load_config

from tests import helm
from tests.cases import LAYERINGS, LMCACHE
from tests.manifests import router_config


def _write_router_config(h4: Path, files: tuple[str, ...], tmp_path: Path, sets: tuple[str, ...] = ()) -> Path:
    docs = helm.render(h4, files, sets)
    path = tmp_path / "router.yaml"
    path.write_text(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])
    return path


@pytest.mark.parametrize("name", LAYERINGS)
def test_rendered_router_config_loads(h4: Path, name: str, tmp_path: Path) -> None:
    config = load_config(_write_router_config(h4, LAYERINGS[name], tmp_path), env={})
    docs = helm.render(h4, LAYERINGS[name])
    values_threshold = int(
        next(
            e for e in helm.one(docs, "Pod", "-helm-test")["spec"]["containers"][0]["env"] if e["name"] == "THRESHOLD"
        )["value"]
    )
    assert config.routing.threshold == values_threshold
    assert config.pools.decode.discovery == "dns"
    assert config.pools.decode.dns.name.startswith("pd-pd-inference-decode.")


def test_rendered_config_carries_the_chosen_values(h4: Path, tmp_path: Path) -> None:
    sets = ("kvTransfer.connector=nixl", "router.threshold=0", "router.sessionAffinityHeader=x-session-id")
    config = load_config(_write_router_config(h4, (), tmp_path, sets), env={})
    assert config.routing.connector == "nixl"
    assert config.routing.threshold == 0
    assert config.routing.session_affinity_header == "x-session-id"


@pytest.mark.parametrize(
    ("files", "sets", "workers"),
    [
        ((), (), 1),  # the default: requests.cpu 1
        ((), ("router.resources.requests.cpu=2500m",), 3),  # rounded up
        ((), ("router.resources.requests.cpu=1", "router.resources.limits.cpu=4"), 4),  # the limit wins
        ((), ("router.workers=5",), 5),
        ((LMCACHE,), ("router.resources.requests.cpu=4",), 1),  # the router binds the notification socket
        ((LMCACHE,), ("kvTransfer.lmcache.notificationReceiver=prefillSidecar", "router.resources.requests.cpu=2"), 2),
    ],
)
def test_router_workers_follow_the_cpu_the_pod_gets(
    h4: Path, tmp_path: Path, files: tuple[str, ...], sets: tuple[str, ...], workers: int
) -> None:
    config = load_config(_write_router_config(h4, files, tmp_path, sets), env={})
    assert config.listen.workers == workers


def test_tokenizer_from_the_hub_is_what_the_engines_serve(h4: Path, tmp_path: Path) -> None:
    sets = (
        "model.name=org/model",
        "model.revision=0123abc",
        "model.hubEndpoint=https://hub.internal/mirror",
        "model.routerTokenizerFromHub=true",
        "model.hfTokenSecret.name=hf",
    )
    hub = load_config(_write_router_config(h4, (), tmp_path, sets), env={}).model.tokenizer_hub
    assert (hub.repo, hub.revision, hub.endpoint) == ("org/model", "0123abc", "https://hub.internal/mirror")
    assert hub.token_file == "/var/run/secrets/huggingface/token"
    docs = helm.render(h4, sets=sets)
    router = helm.one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    probe = router["containers"][0]["startupProbe"]
    # the fetch happens before /health answers: it must fit in the startup probe's budget
    assert hub.timeout_seconds < probe["periodSeconds"] * probe["failureThreshold"]
    mounts = {m["name"]: m for m in router["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in router["volumes"]}
    assert mounts["hf-token"]["mountPath"] + "/token" == hub.token_file
    assert volumes["hf-token"]["secret"]["secretName"] == "hf"
    # off by default: no fetch, no token in the router pod; defaults when only the switch is on
    default = load_config(_write_router_config(h4, (), tmp_path), env={}).model.tokenizer_hub
    assert default.repo == ""
    on = ("model.routerTokenizerFromHub=true",)
    hub = load_config(_write_router_config(h4, (), tmp_path, on), env={}).model.tokenizer_hub
    assert (hub.revision, hub.endpoint, hub.token_file) == ("main", "https://huggingface.co", "")
    assert "hf-token" not in {
        v["name"]
        for v in helm.one(helm.render(h4, sets=on), "Deployment", "-router")["spec"]["template"]["spec"]["volumes"]
    }


def test_loader_rejects_what_the_chart_must_never_render(h4: Path, tmp_path: Path) -> None:
    path = _write_router_config(h4, (), tmp_path)
    path.write_text(path.read_text().replace("threshold:", "treshold:"))
    with pytest.raises(ConfigError, match="routing.treshold"):
        load_config(path, env={})


# The router's own start-up rules the chart mirrors (from pd_router.config, via ci/chartdoc.py):
# values, the router-config field they render to, and the bad value.
ROUTER_RULES = {
    "session affinity header": ({"router": {"sessionAffinityHeader": "X Session"}}, ("routing", "sessionAffinityHeader")),
    "body limit": ({"router": {"limits": {"maxBodyBytes": 100}}}, ("limits", "maxBodyBytes")),
    "header limit": ({"router": {"limits": {"maxHeaders": 8}}}, ("limits", "maxHeaders")),
    "sidecar wait": (
        {"kvTransfer": {"lmcache": {"notificationReceiver": "prefillSidecar", "notifyTimeoutSeconds": 900}}},
        ("lmcache", "notifyTimeoutSeconds"),
    ),
    "sidecar notifications": (
        {
            "kvTransfer": {"lmcache": {"notificationReceiver": "prefillSidecar"}},
            "prefill": {"tensorParallelSize": 65},
            "decode": {"tensorParallelSize": 65},
        },
        ("lmcache", "notificationsPerRequest"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("rule", ROUTER_RULES)
def test_the_chart_refuses_what_the_router_would_refuse_at_start_up(h4: Path, rule: str, tmp_path: Path) -> None:
    """Both sides of each mirrored rule: the router's loader refuses the bad value in a rendered
    config, and the chart refuses the values that would render it, naming the field."""
    import copy

    import yaml
    from pd_router.config import parse_config

    values, (section, field) = ROUTER_RULES[rule]
    base = (LMCACHE,) if "kvTransfer" in values else ()
    good = router_config(helm.render(h4, base))
    bad = copy.deepcopy(good)
    section_values = values.get("router", {}) if section != "lmcache" else values["kvTransfer"]["lmcache"]
    bad.setdefault(section, {})
    if field == "notificationsPerRequest":
        bad["lmcache"].update(notificationReceiver="prefillSidecar", notificationsPerRequest=65)
    else:
        value = section_values.get(field, section_values.get("limits", {}).get(field))
        bad[section][field] = value
        if section == "lmcache":
            bad["lmcache"]["notificationReceiver"] = "prefillSidecar"
    with pytest.raises(ConfigError, match=f"{section}.{field}"):
        parse_config(bad, env={})
    result = helm.template(h4, base, values_yaml=yaml.safe_dump(values))
    assert result.returncode != 0, f"{rule}: the chart rendered what the router refuses"
    assert "panic" not in result.stderr and result.stderr.strip(), result.stderr
