"""Every engine command line the chart renders, parsed by the real `vllm serve` argument parser
of each vLLM version the chart is checked against (Chart.yaml pd-inference.io/checked-vllm)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.engines import rendered, stack

# One worker runs the whole module: its real-stack harness runs once, cached (pytest-xdist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-vllm-cli")

ENGINES = rendered.all_engines()
MODEL_CONFIGS = stack.ROOT / "tests" / "engines" / "model_configs"


def config_dir(model: str) -> str:
    """The folder holding ``model``'s hub config.json (tests/engines/model_configs/README.md)."""
    path = MODEL_CONFIGS / model.replace("/", "--")
    assert (path / "config.json").is_file(), f"add the hub config.json of {model} to {path}"
    return str(path)


CONNECTORS = ["LMCacheConnectorV1", "NixlConnector"]
# The negative controls: things the parser must refuse, or this test proves nothing.
BAD = {
    "unknown flag": ["--no-such-flag-pd-inference=1"],
    "bad kv-transfer-config": ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_rolee": "kv_both"}'],
    "bad kv_role": ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_everything"}'],
    "bad kv-events-config": ["--kv-events-config", '{"enable_kv_cache_event": true, "publisher": "zmq"}'],
}
# ... and command lines that parse but that vLLM must refuse once it knows the model
# (Llama 3.3 70B: 131072 positions, 64 attention heads).
BAD_FOR_THE_MODEL = {
    "context over the model's": ["--max-model-len=200000"],
    "tensor parallelism that does not divide the heads": ["--tensor-parallel-size=3"],
}
LLAMA_70B = "meta-llama/Llama-3.3-70B-Instruct"
# ... and multi-node command lines (a leader of the Llama 3.1 405B profile: TP 16 over two nodes)
# that parse but that vLLM must refuse when it builds the engine's world.
BAD_MULTI_NODE = {
    "nodes that do not divide the world": ["--nnodes=3"],
    "a node rank outside the group": ["--node-rank=2"],
}


@functools.cache
def parsed(version: str) -> dict[str, Any]:
    cases = [{"name": e.name, "args": e.args, "env": e.env, "config_dir": config_dir(e.args[0])} for e in ENGINES]
    base = ENGINES[0].args
    cases += [{"name": f"BAD {name}", "args": [*base, *extra], "env": {}} for name, extra in BAD.items()]
    llama = next(e for e in ENGINES if e.args[0] == LLAMA_70B).args
    cases += [
        {"name": f"BAD {name}", "args": [*llama, *extra], "env": {}, "config_dir": config_dir(LLAMA_70B)}
        for name, extra in BAD_FOR_THE_MODEL.items()
    ]
    leader = next(e for e in ENGINES if e.member == "leader")
    cases += [
        {"name": f"BAD {name}", "args": [*leader.args, *extra], "env": {}, "config_dir": config_dir(leader.args[0])}
        for name, extra in BAD_MULTI_NODE.items()
    ]
    out = stack.run("vllm_cli.py", {"cases": cases, "connectors": CONNECTORS}, vllm=version)
    out["by_name"] = {r["name"]: r for r in out["results"]}
    return out


@pytest.fixture(params=stack.VLLM_VERSIONS, ids=lambda v: f"vllm-{v}")
def vllm_version(request: pytest.FixtureRequest) -> str:
    return request.param


def test_the_installed_vllm_is_the_checked_one(vllm_version: str) -> None:
    assert parsed(vllm_version)["version"] == vllm_version


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_vllm_serve_accepts_the_rendered_command_line(vllm_version: str, engine: rendered.Engine) -> None:
    assert engine.command == ["vllm", "serve"]
    result = parsed(vllm_version)["by_name"][engine.name]
    assert "error" not in result, result.get("error")
    flags = dict(a.split("=", 1) for a in engine.args if a.startswith("--") and "=" in a)
    assert result["model"] == engine.args[0]
    assert result["served_model_name"] == engine.served_names
    served, kv_name = engine.served_names
    assert kv_name.startswith(served + "@kv-")
    assert result["tensor_parallel_size"] == int(flags["--tensor-parallel-size"]) == engine.tp
    assert result["max_model_len"] == int(flags["--max-model-len"])
    assert result["gpu_memory_utilization"] == float(flags["--gpu-memory-utilization"])
    assert (result["host"], result["port"]) == ("0.0.0.0", int(flags["--port"]))
    assert result["revision"] == flags.get("--revision")


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_kv_transfer_config_parses_into_vllms_kv_transfer_config(vllm_version: str, engine: rendered.Engine) -> None:
    result = parsed(vllm_version)["by_name"][engine.name]
    assert result["kv_type"] == "KVTransferConfig"
    rendered_kv = engine.kv_transfer_config
    for key, value in rendered_kv.items():
        assert result["kv"][key] == value, key
    # The connector the chart names is one vLLM has registered, and its class is the one used.
    assert result["connector_class"] in {"LMCacheConnectorV1", "NixlConnector", "NixlPullConnector", "MultiConnector"}
    if result["connector_class"] == "MultiConnector":
        # LMCache's MP mode (kvTransfer.nixl.lmcacheMp): NIXL first (it loads a decode leg's KV),
        # then LMCache's own LMCacheMPConnector class, which vLLM prefers to its copy
        # (kv_connector/v1/lmcache_mp_connector.py) when LMCache is installed, as in the image
        children = result["children"]
        assert [c.get("class") for c in children] in (
            ["NixlConnector", "LMCacheMPConnector"],
            ["NixlPullConnector", "LMCacheMPConnector"],
        ), children
        assert children[1]["module"] == "lmcache.integration.vllm.lmcache_mp_connector", children
        assert children[1]["kv_role"] == "kv_both", children  # it stores only as a producer


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_kv_events_config_parses_into_vllms_kv_events_config(vllm_version: str, engine: rendered.Engine) -> None:
    """The chart's --kv-events-config (engine.kvEvents) is vLLM's KVEventsConfig, field for field,
    and the engine it builds keeps the prefix cache on, without which no block is published."""
    result = parsed(vllm_version)["by_name"][engine.name]
    rendered_events = engine.kv_events_config
    if rendered_events is None:  # off where the chart requires it: renders with data-parallel engines
        dp = [a for e in ENGINES if e.render == engine.render for a in e.args if a.startswith("--data-parallel-size=")]
        assert dp, "engine.kvEvents is on in every render without data parallelism"
        return
    assert result["kv_events"] == rendered_events
    assert result["engine"]["enable_prefix_caching"] is True, (engine.name, result["engine"])


def test_every_vllm_env_var_the_chart_sets_exists_with_a_valid_value(vllm_version: str) -> None:
    out = parsed(vllm_version)
    assert out["env_defined"], "the renders set no VLLM_* variable at all"
    assert {k for k, ok in out["env_defined"].items() if not ok} == set()
    assert {k: e for k, e in out["env_errors"].items() if e} == {}
    assert {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_SSM_CONV_STATE_LAYOUT"} <= set(
        out["env_defined"]
    )


def test_the_parser_refuses_bad_command_lines_negative_control(vllm_version: str) -> None:
    by = parsed(vllm_version)["by_name"]
    for name in BAD:
        assert "error" in by[f"BAD {name}"], f"vLLM {vllm_version} accepted the {name}"
    assert "no-such-flag-pd-inference" in by["BAD unknown flag"]["error"]


def test_the_chart_refuses_lmcache_for_hybrid_models_because_vllm_does(vllm_version: str) -> None:
    """The reason for the chart's LMCache + hybrid refusal (templates/_validate.tpl), from vLLM
    itself: a connector without SupportsHMA turns the hybrid KV-cache manager off."""
    connectors = parsed(vllm_version)["connectors"]
    assert connectors["LMCacheConnectorV1"]["supports_hma"] is False
    assert connectors["NixlConnector"]["supports_hma"] is True


def test_every_render_of_a_hybrid_model_runs_on_a_connector_vllm_gives_hma(vllm_version: str) -> None:
    """Which renders serve a hybrid model is the chart's own judgement (it refuses them on LMCache);
    vLLM must agree that the connector they do render supports hybrid KV caches, and no render
    the chart accepted on LMCache may be one of them."""
    hybrid = [e for e in ENGINES if e.hybrid]
    assert {e.render for e in hybrid} >= {"defaults", "env:dev"}, "the default model (Qwen3.5) is hybrid"
    for e in ENGINES:
        result = parsed(vllm_version)["by_name"][e.name]
        assert result["supports_hma"] is (result["connector_class"] != "LMCacheConnectorV1"), e.name
        if e.hybrid:
            assert result["supports_hma"] is True, e.name


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_vllm_builds_the_whole_engine_config_for_the_model(vllm_version: str, engine: rendered.Engine) -> None:
    """Past the parser: vLLM's checks that need the model (its context length, its heads over
    the tensor-parallel size, its architecture) accept every render, and vLLM's own judgement of
    a hybrid model is the chart's (templates/_helpers.tpl pd-inference.hybridFamily)."""
    result = parsed(vllm_version)["by_name"][engine.name]
    assert "engine_error" not in result, result.get("engine_error")
    eng = result["engine"]
    flags = dict(a.split("=", 1) for a in engine.args if a.startswith("--") and "=" in a)
    assert eng["max_model_len"] == int(flags["--max-model-len"])
    assert eng["tensor_parallel_size"] == engine.tp
    assert eng["is_hybrid"] is engine.hybrid, (engine.name, eng)


def engine_config_refusals(version: str, cases: dict[str, list[str]]) -> dict[str, str]:
    """Each bad case's error from vLLM's engine config, which must refuse what its parser accepted."""
    by = parsed(version)["by_name"]
    out = {}
    for name in cases:
        result = by[f"BAD {name}"]
        assert "error" not in result, result  # the parser alone accepts it ...
        assert "engine_error" in result, f"vLLM {version} built an engine config with {name}"
        out[name] = result["engine_error"]
    return out


def test_the_engine_config_refuses_what_the_model_cannot_do_negative_control(vllm_version: str) -> None:
    assert "max_model_len" in engine_config_refusals(vllm_version, BAD_FOR_THE_MODEL)["context over the model's"]


# The parts each NixlConnector kv_role lets an engine take: (prefill side, decode side).
KV_PARTS = {"kv_producer": (True, False), "kv_consumer": (False, True), "kv_both": (True, True)}
NIXL = [e for e in ENGINES if e.kv_transfer_config["kv_connector"] == "NixlConnector"]


def test_renders_cover_every_kv_role() -> None:
    """Split's producers and consumers, and the flexible layout's engines that take either part
    (engine.layout flexible, scenario:flexible): the decode engines, and no prefill engine there."""
    assert {e.kv_transfer_config["kv_role"] for e in NIXL} == set(KV_PARTS)
    flexible = [e for e in ENGINES if e.render == "scenario:flexible"]
    assert [(e.role, e.kv_transfer_config["kv_role"]) for e in flexible] == [("decode", "kv_both")]


@pytest.mark.parametrize("engine", NIXL, ids=lambda e: e.name)
def test_vllm_lets_each_engine_take_the_parts_its_layout_gives_it(vllm_version: str, engine: rendered.Engine) -> None:
    """vLLM's own reading of the rendered kv_role: a prefiller produces, a decoder consumes, and a
    flexible engine (kv_both) does both, which is what prefilling for another engine and decoding
    what another prefilled needs."""
    kv = parsed(vllm_version)["by_name"][engine.name]["kv"]
    assert (kv["is_kv_producer"], kv["is_kv_consumer"]) == KV_PARTS[engine.kv_transfer_config["kv_role"]]


MULTI_NODE = [e for e in ENGINES if e.member != "single" or any(a.startswith("--data-parallel-size=") for a in e.args)]


def test_renders_cover_every_engine_shape() -> None:
    shapes = {e.member for e in ENGINES}
    assert shapes == {"single", "leader", "worker"}, shapes
    assert any("--enable-expert-parallel" in e.args and e.member == "worker" for e in ENGINES)


@pytest.mark.parametrize("engine", MULTI_NODE, ids=lambda e: e.name)
def test_vllm_reads_the_multi_node_flags_as_the_chart_means_them(vllm_version: str, engine: rendered.Engine) -> None:
    """A LeaderWorkerSet group's pods, as vLLM sees them once Kubernetes has expanded LWS's
    variables: one world of tensorParallelSize x dataParallelSize GPUs over --nnodes, the leader
    rank 0 serving the API, the worker its LWS_WORKER_INDEX and headless, every pod's
    data-parallel ranks its even share (engine/_args.tpl)."""
    result = parsed(vllm_version)["by_name"][engine.name]
    assert "error" not in result and "engine_error" not in result, result
    flags = dict(a.split("=", 1) for a in engine.args if a.startswith("--") and "=" in a)
    nodes, dp = int(flags.get("--nnodes", 1)), int(flags.get("--data-parallel-size", 1))
    par, eng = result["parallel"], result["engine"]
    assert par["nnodes"] == nodes and par["data_parallel_size"] == dp
    assert par["headless"] is (engine.member == "worker")
    assert (
        par["node_rank"]
        == {"single": 0, "leader": 0, "worker": int(rendered.LWS_ENV["LWS_WORKER_INDEX"])}[engine.member]
    )
    if nodes > 1:
        assert par["master_addr"] == rendered.LWS_ENV["LWS_LEADER_ADDRESS"]
        assert engine.env["VLLM_HOST_IP"] == rendered.LWS_ENV["POD_IP"]
    assert eng["world_size"] == engine.tp * dp
    assert eng["data_parallel_size_local"] == max(dp // nodes, 1)
    assert eng["data_parallel_rank"] == (par["node_rank"] * dp) // nodes
    assert eng["enable_expert_parallel"] is ("--enable-expert-parallel" in engine.args)


def test_vllm_refuses_a_group_it_cannot_build_negative_control(vllm_version: str) -> None:
    refused = engine_config_refusals(vllm_version, BAD_MULTI_NODE)
    assert "--nnodes" in refused["nodes that do not divide the world"]
    assert "--node-rank" in refused["a node rank outside the group"]
