"""Runs in the real engine stack: load rendered LMCache configs exactly as vLLM's
LMCacheConnectorV1 does in LMCache 0.5.6, then build LMCache's PD config for every TP rank.

stdin:  {"cases": [{"name", "yaml": <the ConfigMap's lmcache.yaml>, "env": {LMCACHE_*: ...}, "tp"}]}
stdout: {"defined_keys": [...], "results": [{"name", "unknown", "warnings", "mismatches", "pd"}]}

The loader is `lmcache.integration.vllm.utils.lmcache_get_or_create_config` (LMCACHE_CONFIG_FILE,
then the LMCACHE_* env, then validate), what `LMCacheConnectorV1Impl.__init__` calls
(integration/vllm/vllm_v1_adapter.py). LMCache only *logs* unknown keys and values it changes, so
its log records at WARNING and above are captured and returned, never just printed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

import torch
from lmcache.integration.vllm import utils
from lmcache.v1 import config as lmcache_config
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import pd_backend, pd_backend_async


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def same(rendered: object, loaded: object) -> bool:
    """Equal value AND type (bool is not int here: LMCache reads 'yes' as False). The one change
    allowed is an integer read into a float key (pd_allocation_timeout_sec: 60 -> 60.0)."""
    if isinstance(rendered, list):
        return isinstance(loaded, list) and len(rendered) == len(loaded) and all(map(same, rendered, loaded))
    if type(rendered) is int and type(loaded) is float:
        return rendered == loaded
    return type(rendered) is type(loaded) and rendered == loaded


def load(case: dict, capture: Capture) -> dict:
    import yaml

    for key in [k for k in os.environ if k.startswith("LMCACHE_")]:
        del os.environ[key]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(case["yaml"])
    os.environ["LMCACHE_CONFIG_FILE"] = f.name
    os.environ.update(case.get("env", {}))
    rendered = yaml.safe_load(case["yaml"])
    utils._config_instance = None  # the loader is a process-wide singleton
    capture.messages.clear()
    cfg = utils.lmcache_get_or_create_config()
    out: dict = {"name": case["name"], "warnings": list(capture.messages)}
    out["unknown"] = sorted(set(rendered) - set(lmcache_config._CONFIG_DEFINITIONS))
    out["mismatches"] = [
        f"{key}: rendered {value!r}, LMCache holds {getattr(cfg, key, None)!r}"
        for key, value in rendered.items()
        if key not in out["unknown"] and not same(value, getattr(cfg, key, None))
    ]
    # The PD backend vLLM's worker creates (pd_backend_mode picks async or sync) builds its PD
    # config per TP rank from the loaded config: ports are indexed by rank there.
    module = pd_backend_async if cfg.pd_backend_mode == "async" else pd_backend
    out["pd_backend_mode"] = cfg.pd_backend_mode
    out["pd"] = []
    for rank in range(case["tp"]):
        meta = LMCacheMetadata(
            model_name="m",
            world_size=case["tp"],
            local_world_size=case["tp"],
            worker_id=rank,
            local_worker_id=rank,
            kv_dtype=torch.bfloat16,
            kv_shape=(1, 2, cfg.chunk_size, 1, 64),
        )
        try:
            pd = module.PDConfig.from_cache_engine_config(cfg, meta, rank)
        except Exception as exc:  # an IndexError here means too few ports for the TP size
            out["pd"].append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        out["pd"].append(
            {
                "role": pd.role,
                "peer_host": pd.peer_host,
                "peer_init_port": pd.peer_init_port,
                "peer_alloc_port": pd.peer_alloc_port,
                "proxy_host": pd.proxy_host,
                "proxy_port": pd.proxy_port,
                "buffer_size": pd.buffer_size,
                "buffer_device": pd.buffer_device,
            }
        )
    os.unlink(f.name)
    return out


def main() -> None:
    payload = json.load(sys.stdin)
    capture = Capture()
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).addHandler(capture)
    results = [load(case, capture) for case in payload["cases"]]
    print(json.dumps({"defined_keys": sorted(lmcache_config._CONFIG_DEFINITIONS), "results": results}))


if __name__ == "__main__":
    main()
