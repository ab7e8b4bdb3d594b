"""``pd-sim-engine``: run one simulated vLLM engine (``python -m pd_router_dev.sim``)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pd_router_dev.sim.engine import BLOCK_SIZE
from pd_router_dev.sim.kv_events import parse_config as parse_kv_events
from pd_router_dev.sim.protocol import VERSIONS
from pd_router_dev.sim.server import FAULTS, SimConfig, serve


def _ports(s: str) -> list[int]:
    return [int(p) for p in s.split(",") if p.strip()]


def parse_args(argv: list[str] | None = None) -> tuple[SimConfig, str | None]:
    p = argparse.ArgumentParser(prog="pd-sim-engine", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port")
    p.add_argument("--port-file", help="write the bound HTTP port here once listening")
    p.add_argument("--model", default="llama-3.3-70b")
    p.add_argument(
        "--alias",
        action="append",
        default=[],
        help="a further served name (vLLM --served-model-name: its later names); repeatable",
    )
    p.add_argument(
        "--lora-module",
        action="append",
        default=[],
        help="a LoRA adapter, NAME or NAME=PATH (vLLM --lora-modules; its answers are its own, "
        "its card's root PATH, default /adapters/NAME); repeatable",
    )
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--kv-connector", choices=["none", "nixl", "lmcache"], default="none")
    p.add_argument("--lmcache-role", choices=["sender", "receiver"], default="sender")
    p.add_argument("--pd-proxy-host", default="127.0.0.1", help="LMCache sender: proxy host")
    p.add_argument("--pd-proxy-port", type=int, default=7500, help="LMCache sender: proxy port")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks)")
    p.add_argument("--pd-peer-host", default=None, help="LMCache receiver bind host")
    p.add_argument("--pd-peer-init-port", type=_ports, default=[7300])
    p.add_argument("--pd-peer-alloc-port", type=_ports, default=[7400])
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    p.add_argument("--decode-step-ms", type=float, default=0.0)
    p.add_argument("--decode-step-ms-per-seq", type=float, default=0.0)
    p.add_argument("--transfer-ms", type=float, default=0.0)
    p.add_argument("--slow-factor", type=float, default=20.0)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--engine-id", default="")
    p.add_argument(
        "--weights-seed",
        type=int,
        default=0,
        help="other weights under the same name (0 = the model's own): other greedy answers",
    )
    p.add_argument(
        "--vllm-version",
        choices=VERSIONS,
        default=SimConfig.vllm_version,
        help="vLLM whose rules to follow (0.33: only the prompt must fit max_model_len)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SimConfig.max_num_batched_tokens,
        help="scheduler token budget per step (default: vLLM's for an API server on H100/H200; "
        "on a smaller GPU such as the L4 of g6 vLLM uses 2048)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=SimConfig.max_num_seqs,
        help="most sequences running (vLLM: 1024 on H100/H200, 256 on an L4)",
    )
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=SimConfig.num_gpu_blocks,
        help="KV-cache blocks (16 tokens each) behind vllm:kv_cache_usage_perc",
    )
    p.add_argument(
        "--step-time",
        choices=["sum", "max"],
        default=SimConfig.step_time,
        help="a step's duration: prefill + decode time (sum), or the larger of its "
        "compute-bound and memory-bound times (max, a roofline; see sim/engine.py)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=SimConfig.prefix_cache_tokens,
        help="vLLM's automatic prefix caching: the tokens of KV its block pool holds (16-token "
        "blocks, least recently used evicted first); 0 = off, as --no-enable-prefix-caching",
    )
    p.add_argument(
        "--kv-events-config",
        default="",
        help="vLLM's KV-cache event publisher (JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}\'); needs prefix caching',
    )
    a = p.parse_args(argv)
    if a.max_num_batched_tokens < 1 or a.max_num_seqs < 1 or a.num_gpu_blocks_override < 1:
        p.error(
            "--max-num-batched-tokens, --max-num-seqs and --num-gpu-blocks-override must be >= 1"
        )
    if a.prefix_cache_tokens < 0 or 0 < a.prefix_cache_tokens < 2 * BLOCK_SIZE:
        # one block is vLLM's null block (block_pool.py), never handed out
        p.error(f"--prefix-cache-tokens must be 0 (off) or at least {2 * BLOCK_SIZE}")
    if a.kv_events_config:
        try:
            parse_kv_events(a.kv_events_config)
        except ValueError as exc:  # json's error is one too
            p.error(f"--kv-events-config: {exc}")
    cfg = SimConfig(
        host=a.host,
        port=a.port,
        model=a.model,
        aliases=tuple(a.alias),
        lora_modules=tuple(m.partition("=")[0] for m in a.lora_module),
        lora_roots=tuple(m.partition("=")[2] or f"/adapters/{m}" for m in a.lora_module),
        max_model_len=a.max_model_len,
        kv_connector=a.kv_connector,
        lmcache_role=a.lmcache_role,
        pd_proxy_host=a.pd_proxy_host,
        pd_proxy_port=a.pd_proxy_port,
        tp=a.tp,
        pd_peer_host=a.pd_peer_host or a.host,
        pd_peer_init_port=a.pd_peer_init_port,
        pd_peer_alloc_port=a.pd_peer_alloc_port,
        prefill_ms_per_token=a.prefill_ms_per_token,
        decode_step_ms=a.decode_step_ms,
        decode_step_ms_per_seq=a.decode_step_ms_per_seq,
        transfer_ms=a.transfer_ms,
        slow_factor=a.slow_factor,
        fault=a.fault,
        engine_id=a.engine_id,
        weights_seed=a.weights_seed,
        vllm_version=a.vllm_version,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        num_gpu_blocks=a.num_gpu_blocks_override,
        step_time=a.step_time,
        prefix_cache_tokens=a.prefix_cache_tokens,
        kv_events_config=a.kv_events_config,
    )
    return cfg, a.port_file


def main(argv: list[str] | None = None) -> int:
    cfg, port_file = parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    def _term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        asyncio.run(serve(cfg, port_file))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
