"""Runs in the real engine stack: what LMCache 0.5.6 makes of the chart's LMCache MP pieces
(kvTransfer.nixl.lmcacheMp), read with its own code.

stdin:  {"cases": [{"name", "server": [args after `python -m lmcache.v1.multiprocess.http_server`],
                    "connector": {the LMCacheMPConnector child's kv_connector_extra_config}}]}
stdout: {"known_keys": [...], "results": [{"name", "server" | "server_error", "unknown_keys",
                                          "transfer_mode" | "transfer_mode_error"}]}

The server's arguments go through its module's own parser and converters (lmcache/v1/
multiprocess/http_server.py ``parse_args`` and the ``parse_args_to_*`` calls of its ``__main__``);
the connector's keys are checked against those LMCache's MP connector and its adapter read: the
adapter's ``ExtraConfigDefault`` members (integration/vllm/vllm_multi_process_adapter.py), under
its ``lmcache.mp.`` prefix, and the ``lmcache.mp.*`` literals of the connector
(integration/vllm/lmcache_mp_connector.py, the class vLLM 0.31 loads when LMCache is installed).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

from lmcache.integration.vllm import lmcache_mp_connector
from lmcache.integration.vllm import vllm_multi_process_adapter as adapter
from lmcache.v1.multiprocess import http_server
from lmcache.v1.multiprocess.transfer_mode import MPTransferMode


def known_keys() -> set[str]:
    prefix = adapter._EXTRA_CONFIG_KEY_PREFIX
    keys = {prefix + m.name for m in adapter.ExtraConfigDefault}
    source = Path(lmcache_mp_connector.__file__).read_text()
    keys |= set(re.findall(r'"(lmcache\.mp\.[a-z_.]+)"', source))
    return keys


def server(args: list[str]) -> dict:
    saved, err = sys.argv, io.StringIO()
    sys.argv = ["http_server", *args]
    try:
        with contextlib.redirect_stderr(err):
            a = http_server.parse_args()
        http = http_server.parse_args_to_http_frontend_config(a)
        mp = http_server.parse_args_to_mp_server_config(a)
        storage = http_server.parse_args_to_config(a)
        obs = http_server.parse_args_to_observability_config(a)
    except SystemExit as exc:
        return {"server_error": f"exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"}
    except Exception as exc:  # a converter's refusal
        return {"server_error": f"{type(exc).__name__}: {exc}"}
    finally:
        sys.argv = saved
    l1 = storage.l1_manager_config
    return {
        "server": {
            "host": mp.host,
            "port": mp.port,
            "chunk_size": mp.chunk_size,
            "supported_transfer_mode": mp.supported_transfer_mode,
            "isolated_ipc": mp.isolated_ipc,
            "hash_algorithm": mp.hash_algorithm,
            "http_host": http.http_host,
            "http_port": http.http_port,
            "l1_bytes": l1.memory_config.size_in_bytes,
            "eviction_policy": l1.eviction.eviction_policy,
            "metrics": obs.metrics_enabled,
        }
    }


def main() -> None:
    payload = json.load(sys.stdin)
    keys = known_keys()
    results = []
    for case in payload["cases"]:
        with contextlib.redirect_stdout(sys.stderr):  # LMCache logs to stdout
            results.append(one(case, keys))
    json.dump({"known_keys": sorted(keys), "results": results}, sys.stdout)


def one(case: dict, keys: set[str]) -> dict:
    out: dict = {"name": case["name"], **server(case["server"])}
    extra = case["connector"]
    out["unknown_keys"] = sorted(k for k in extra if k not in keys)
    try:
        out["transfer_mode"] = MPTransferMode(extra.get("lmcache.mp.mp_transfer_mode", "auto")).value
    except ValueError as exc:
        out["transfer_mode_error"] = str(exc)
    return out


if __name__ == "__main__":
    main()
