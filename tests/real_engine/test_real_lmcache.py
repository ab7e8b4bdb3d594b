"""LMCache 0.5.6's PD mode on vLLM's CPU build: it cannot run there, and this test keeps that
statement (README, "Status"; docs/testing.md) true. A decoder started with the chart's own LMCache render
(tests/values/lmcache.yaml; the buffer in host memory, the receiver on loopback) serves, but
LMCache's engine fails to build: ``CreateGPUConnector`` (lmcache/v1/gpu_connector/__init__.py)
knows no connector for torch's ``cpu`` device, and LMCache runs "in degraded mode (recompute)",
so no KV would ever move. The LMCache route is proven against the real LMCache package's control
plane instead (tests/engines/test_engine_lmcache_*.py: its config loader and its PD sender's
wire format) and against the simulator. Should a later LMCache run on CPU, this test fails and
the LMCache route gets the NIXL route's token-for-token tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.real_engine import engines
from tests.real_engine.conftest import Pairs

RENDER = "scenario:lmcache"


def test_lmcache_pd_does_not_run_on_vllms_cpu_build(workdir: Path, pairs: Pairs) -> None:
    pairs.stop()  # one engine more would not fit beside a pair (conftest.Pairs)
    rendered = engines.chart_engine("decode", RENDER)
    cfg = yaml.safe_load(rendered.lmcache_yaml or "")
    assert cfg["enable_pd"] is True and cfg["pd_role"] == "receiver"
    cfg.update(
        pd_buffer_device="cpu",
        pd_buffer_size=64 << 20,
        pd_peer_host="127.0.0.1",
        pd_peer_init_port=[engines.free_port()],
        pd_peer_alloc_port=[engines.free_port()],
    )
    work = workdir / "lmcache"
    work.mkdir(exist_ok=True)
    (work / "lmcache.yaml").write_text(yaml.safe_dump(cfg))
    dec = engines.engine("decode", "dense", 1, work, render=RENDER)
    dec.env["LMCACHE_CONFIG_FILE"] = str(work / "lmcache.yaml")
    served = dec.argv[dec.argv.index("--served-model-name") + 1]
    with engines.running([dec]):
        status, body, _ = engines.post(dec.url, "/v1/completions", {"model": served, "prompt": "hi", "max_tokens": 2})
        log = dec.log_tail(10**7)
    assert status == 200, body
    assert "LMCacheConnectorV1" in log and "RuntimeError: No supported cpu connector found." in log
    assert "System will operate in degraded mode (recompute)." in log
