"""LMCache's MP mode as the chart renders it (kvTransfer.nixl.lmcacheMp), read by LMCache 0.5.6's
own code: the server container's arguments through its module's parser and converters, the
LMCacheMPConnector child's keys against those its connector reads (tests/engines/harness/
lmcache_mp.py). vLLM's side, the MultiConnector and the class each child loads, is
test_engine_vllm_cli.py's."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.engines import rendered, stack

pytestmark = pytest.mark.xdist_group("engine-lmcache-mp")

ENGINES = [e for e in rendered.all_engines() if e.lmcache_server is not None]
MODULE = ["-m", "lmcache.v1.multiprocess.http_server"]
# The negative controls: what LMCache's parser or converters must refuse, or this proves nothing.
BAD = {
    "unknown flag": ["--no-such-flag=1"],
    "L1 memory without an eviction policy": ["--l1-size-gb=4"],
    "an unknown transfer mode": ["--l1-size-gb=4", "--eviction-policy=LRU", "--supported-transfer-mode=zero_copy"],
}


def child(engine: rendered.Engine) -> dict[str, Any]:
    (lmc,) = [
        c
        for c in engine.kv_transfer_config["kv_connector_extra_config"]["connectors"]
        if c["kv_connector"] == "LMCacheMPConnector"
    ]
    return lmc["kv_connector_extra_config"]


def server_args(engine: rendered.Engine) -> list[str]:
    cmd = engine.lmcache_server or []
    i = cmd.index(MODULE[1])
    assert cmd[i - 1 : i + 1] == MODULE, cmd  # the module `lmcache server` runs (LMCache 0.5.6 cli/commands/server.py)
    return cmd[i + 1 :]


@functools.cache
def checked() -> dict[str, Any]:
    cases = [{"name": e.name, "server": server_args(e), "connector": child(e)} for e in ENGINES]
    cases += [{"name": f"BAD {n}", "server": a, "connector": {"lmcache.mp.no_such_key": 1}} for n, a in BAD.items()]
    out = stack.run("lmcache_mp.py", {"cases": cases}, vllm=stack.VLLM_VERSIONS[0])
    out["by_name"] = {r["name"]: r for r in out["results"]}
    return out


def test_some_render_runs_lmcache_mp() -> None:
    assert {e.render for e in ENGINES} >= {"scenario:lmcache-mp+dev"}
    assert {e.role for e in ENGINES} == {"prefill", "decode"}


def test_the_negative_controls_are_refused() -> None:
    for name in BAD:
        r = checked()["by_name"][f"BAD {name}"]
        assert "server_error" in r, (name, r)
        assert r["unknown_keys"] == ["lmcache.mp.no_such_key"]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_the_server_and_the_connector_agree_as_lmcache_reads_them(engine: rendered.Engine) -> None:
    r = checked()["by_name"][engine.name]
    assert "server_error" not in r, r
    s, extra = r["server"], child(engine)
    # the connector reaches the pod's own server, on loopback
    assert (s["host"], f"tcp://{s['host']}", s["port"]) == (
        "127.0.0.1",
        extra["lmcache.mp.host"],
        extra["lmcache.mp.port"],
    )
    assert r["unknown_keys"] == [], "keys LMCache's MP connector does not read"
    # both engine-driven: the server's container sees no GPU (engine/_pod.tpl lmcacheServer)
    assert (s["supported_transfer_mode"], r["transfer_mode"]) == ("engine_driven", "engine_driven")
    # settings that must match on both sides keep LMCache's defaults on both
    assert (s["isolated_ipc"], s["hash_algorithm"]) == (False, "blake3")
    assert not {"lmcache.mp.isolated_ipc", "lmcache.mp.hash_algorithm"} & set(extra)
    # its HTTP API (it can clear the cache, unauthenticated) on loopback too; its own metrics off
    assert s["http_host"] == "127.0.0.1" and s["metrics"] is False
    flags = dict(a.split("=", 1) for a in server_args(engine) if "=" in a)
    # LMCache reads --l1-size-gb as GiB (2 ** 30), what the chart's l1SizeGiB says
    assert s["l1_bytes"] == int(flags["--l1-size-gb"]) * 2**30
    assert s["chunk_size"] == int(flags["--chunk-size"]) and s["chunk_size"] % 16 == 0  # vLLM's GPU block
    assert s["eviction_policy"] == flags["--eviction-policy"]
