"""Runs in the real engine stack with one vLLM version on PYTHONPATH: parse rendered engine
command lines with `vllm serve`'s own argument parser, validate them as `vllm serve` does, build
AsyncEngineArgs, and look at what vLLM made of the KV-transfer config and the env.

stdin:  {"cases": [{"name", "args": [...after `vllm serve`], "env": {VLLM_*: ...},
                    "config_dir": DIR (optional)}],
         "connectors": ["LMCacheConnectorV1", ...]}
stdout: {"version", "results": [{"name", "error" | parsed fields, "engine" | "engine_error"}],
         "connectors": {name: {...}}, "env_defined": {VAR: bool}}

With ``config_dir`` (the model's hub ``config.json``, tests/engines/model_configs/), the engine
config is built too (``AsyncEngineArgs.create_engine_config``, the model given as that folder,
the tokenizer not loaded): vLLM's model-dependent checks (context length against the model's,
heads against the tensor-parallel size, the architecture, hybrid detection) run, on the CPU
platform (``VLLM_TARGET_DEVICE=cpu``), so its block size is the CPU's, not a GPU's.

The parser is built the way vLLM's CLI builds it (vllm/entrypoints/cli/main.py: a top-level
FlexibleArgumentParser with subcommands; ServeSubcommand.subparser_init adds every engine and
frontend flag), checked against vLLM 0.31.0 and 0.33.0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import vllm
import vllm.envs as envs
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def build_parser() -> tuple[FlexibleArgumentParser, ServeSubcommand]:
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers).set_defaults(dispatch_function=serve.cmd)
    return parser, serve


def parse(case: dict) -> dict:
    saved = dict(os.environ)
    os.environ.update(case.get("env", {}))
    err = io.StringIO()
    try:
        parser, serve = build_parser()
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["serve", *case["args"]])
        if getattr(args, "model_tag", None):
            args.model = args.model_tag  # as ServeSubcommand.cmd does
        serve.validate(args)
        ea = AsyncEngineArgs.from_cli_args(args)
    except SystemExit as exc:
        return {"name": case["name"], "error": f"exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"}
    except Exception as exc:
        return {"name": case["name"], "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    kv = ea.kv_transfer_config
    out = {
        "name": case["name"],
        "model": ea.model,
        "served_model_name": ea.served_model_name,
        "revision": ea.revision,
        "tensor_parallel_size": ea.tensor_parallel_size,
        "max_model_len": ea.max_model_len,
        "gpu_memory_utilization": ea.gpu_memory_utilization,
        "host": args.host,
        "port": args.port,
        "kv_type": type(kv).__name__,
        # Multi-node and data-parallel flags (engine/_args.tpl pd-inference.engine.parallelArgs)
        "parallel": {
            "nnodes": ea.nnodes,
            "node_rank": ea.node_rank,
            "master_addr": ea.master_addr,
            "headless": bool(getattr(args, "headless", False)),
            "data_parallel_size": ea.data_parallel_size,
            "enable_expert_parallel": ea.enable_expert_parallel,
        },
    }
    if isinstance(kv, KVTransferConfig):
        out["kv"] = {
            "kv_connector": kv.kv_connector,
            "kv_role": kv.kv_role,
            "kv_buffer_device": kv.kv_buffer_device,
            "kv_load_failure_policy": getattr(kv, "kv_load_failure_policy", None),
            "kv_connector_extra_config": kv.kv_connector_extra_config,
            # the parts vLLM lets this engine take: a hand-off's prefill side, its decode side, or both (kv_both)
            "is_kv_producer": kv.is_kv_producer,
            "is_kv_consumer": kv.is_kv_consumer,
        }
        cls = KVConnectorFactory.get_connector_class(kv)
        out["connector_class"] = cls.__name__
        out["supports_hma"] = KVConnectorFactory.supports_hma_config(kv)
        if kv.kv_connector == "MultiConnector":
            # each child as MultiConnector builds it (multi_connector.py: a KVTransferConfig of
            # the entry's own fields), and the class vLLM loads for it
            children = []
            for entry in (kv.kv_connector_extra_config or {}).get("connectors", []):
                try:
                    child = KVTransferConfig(**entry)
                    c = KVConnectorFactory.get_connector_class(child)
                    children.append({"class": c.__name__, "module": c.__module__, "kv_role": child.kv_role})
                except Exception as exc:
                    children.append({"error": f"{type(exc).__name__}: {exc}"})
            out["children"] = children
    ke = ea.kv_events_config
    if ke is not None:
        out["kv_events"] = {
            k: getattr(ke, k) for k in ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic")
        }
    if case.get("config_dir"):
        out.update(engine_config(ea, case["config_dir"], headless=out["parallel"]["headless"]))
    return out


def engine_config(ea: AsyncEngineArgs, config_dir: str, headless: bool = False) -> dict:
    ea.model = ea.tokenizer = config_dir
    ea.skip_tokenizer_init = True
    # A reasoning parser reads the tokenizer's vocabulary (its think tokens), which only the hub
    # has: the parser above checked its name, the engine config is built without it.
    ea.reasoning_parser = ""
    try:
        cfg = ea.create_engine_config(headless=headless)
    except Exception as exc:  # pydantic's ValidationError or vLLM's own ValueError
        return {"engine_error": f"{type(exc).__name__}: {exc}"[:800]}
    mc = cfg.model_config
    return {
        "engine": {
            "architecture": mc.architecture,
            "is_hybrid": mc.is_hybrid,
            "max_model_len": mc.max_model_len,
            "block_size": cfg.cache_config.block_size,
            # KV-cache events publish only the blocks the prefix cache stores
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            # what vLLM makes of --nnodes/--node-rank: the world, and this node's data-parallel ranks
            "world_size": cfg.parallel_config.world_size_across_dp,
            "data_parallel_size": cfg.parallel_config.data_parallel_size,
            "data_parallel_size_local": cfg.parallel_config.data_parallel_size_local,
            "data_parallel_rank": cfg.parallel_config.data_parallel_rank,
            "enable_expert_parallel": cfg.parallel_config.enable_expert_parallel,
        }
    }


def env_value_ok(name: str, value: str) -> str | None:
    """None when vLLM accepts `value` for `name` (its getter validates choices), else the error."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        envs.environment_variables[name]()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def main() -> None:
    payload = json.load(sys.stdin)
    results = [parse(case) for case in payload["cases"]]
    env_vars = {k: v for case in payload["cases"] for k, v in case.get("env", {}).items() if k.startswith("VLLM_")}
    connectors = {}
    for name in payload.get("connectors", []):
        cls = KVConnectorFactory.get_connector_class_by_name(name)
        connectors[name] = {"class": f"{cls.__module__}.{cls.__name__}", "supports_hma": supports_hma(cls)}
    print(
        json.dumps(
            {
                "version": vllm.__version__,
                "results": results,
                "connectors": connectors,
                "env_defined": {k: k in envs.environment_variables for k in env_vars},
                "env_errors": {k: env_value_ok(k, v) for k, v in env_vars.items() if k in envs.environment_variables},
            }
        )
    )


if __name__ == "__main__":
    main()
