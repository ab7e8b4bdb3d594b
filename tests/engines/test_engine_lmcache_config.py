"""Every LMCache config the chart renders, loaded by the real LMCache (0.5.6) exactly as vLLM's
LMCacheConnectorV1 loads it, then turned into LMCache's PD config for every TP rank."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engines import rendered, stack

# One worker runs the whole module: its real-stack harness runs once, cached (pytest-xdist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-lmcache-config")

ROOT = Path(__file__).resolve().parents[2]
ENGINES = [e for e in rendered.all_engines(rendered.LMCACHE_RENDERS) if e.lmcache_yaml is not None]


@functools.cache
def loaded() -> dict[str, Any]:
    """One run of the real loader over every rendered config (importing LMCache takes seconds)."""
    cases = [
        {
            "name": e.name,
            "yaml": e.lmcache_yaml,
            "env": {k: v for k, v in e.env.items() if k.startswith("LMCACHE_") and k != "LMCACHE_CONFIG_FILE"},
            "tp": e.tp,
        }
        for e in ENGINES
    ]
    out = stack.run("lmcache_config.py", {"cases": cases})
    out["by_name"] = {r["name"]: r for r in out["results"]}
    return out


def test_every_lmcache_render_is_covered() -> None:
    names = {e.render for e in ENGINES}
    assert {"env:staging (lmcache)", "scenario:lmcache tp4", "scenario:lmcache sidecar"} <= names
    assert len(ENGINES) == 2 * len(rendered.LMCACHE_RENDERS)  # both roles of each


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_lmcache_loads_the_rendered_config_unchanged(engine: rendered.Engine) -> None:
    result = loaded()["by_name"][engine.name]
    assert result["unknown"] == [], "LMCache would ignore these keys"
    assert result["mismatches"] == [], "a value LMCache reads differently (None, another type, another value)"
    # No warning at all: LMCache logs every key it ignores and every value it overrides
    # (e.g. save_unfull_chunk forced true for PD when the chart did not render it).
    assert result["warnings"] == []


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_pd_config_of_every_tp_rank(engine: rendered.Engine) -> None:
    cfg = yaml.safe_load(engine.lmcache_yaml or "")
    pd = loaded()["by_name"][engine.name]["pd"]
    assert len(pd) == engine.tp and not [p for p in pd if "error" in p], pd
    for rank, p in enumerate(pd):
        assert p["buffer_size"] == cfg["pd_buffer_size"]
        # cuda buffers live on the rank's own GPU (LMCache transfer_utils.get_correct_device)
        assert p["buffer_device"] == ("cpu" if cfg["pd_buffer_device"] == "cpu" else f"cuda:{rank}")
        if engine.role == "decode":
            assert p["role"] == "receiver"
            assert p["peer_init_port"] == cfg["pd_peer_init_port"][rank]
            assert p["peer_alloc_port"] == cfg["pd_peer_alloc_port"][rank]
            assert p["peer_host"] == "0.0.0.0"
        else:
            assert p["role"] == "sender"
            assert (p["proxy_host"], p["proxy_port"]) == (cfg["pd_proxy_host"], cfg["pd_proxy_port"])


def test_the_key_list_the_schema_checks_extraconfig_against_is_lmcaches() -> None:
    """ci/data/lmcache-0.5.6-config-keys.txt (the schema's allow-list) is exactly what LMCache defines."""
    listed = {
        line.strip()
        for line in (ROOT / "ci/data/lmcache-0.5.6-config-keys.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert listed == set(loaded()["defined_keys"])


def test_a_bad_config_is_caught_negative_control() -> None:
    """The harness sees what LMCache only logs: a retired key, a value turned None, a type change."""
    good = yaml.safe_load(ENGINES[0].lmcache_yaml or "")
    cases = [
        {"name": "retired", "yaml": yaml.safe_dump({**good, "enable_nixl": True}), "env": {}, "tp": 1},
        {
            "name": "no_save_unfull",
            "yaml": yaml.safe_dump({k: v for k, v in good.items() if k != "save_unfull_chunk"}),
            "env": {},
            "tp": 1,
        },
        {"name": "string_bool", "yaml": yaml.safe_dump({**good, "local_cpu": "no"}), "env": {}, "tp": 1},
        {"name": "env_override", "yaml": yaml.safe_dump(good), "env": {"LMCACHE_CHUNK_SIZE": "512"}, "tp": 1},
    ]
    by = {r["name"]: r for r in stack.run("lmcache_config.py", {"cases": cases})["results"]}
    assert by["retired"]["unknown"] == ["enable_nixl"]
    assert any("Unknown configuration key: enable_nixl" in w for w in by["retired"]["warnings"])
    assert any("save_unfull_chunk" in w for w in by["no_save_unfull"]["warnings"])
    assert by["string_bool"]["mismatches"]
    assert by["env_override"]["mismatches"] == ["chunk_size: rendered 256, LMCache holds 512"]
