"""Runs in the real engine stack: a prefill engine whose KV hand-off is LMCache 0.5.6's own
PDBackendAsync, sender AND receiver, over NIXL (UCX) on CPU buffers.

    python lmcache_prefiller.py < config.json     # serves until killed

The HTTP side is the part of vLLM the router talks to during an LMCache hand-off: GET /health,
POST /tokenize and the one-token prefill leg, POST /v1/completions of token ids or of the client's
text, or POST /v1/chat/completions, the last two with `return_token_ids` as vLLM 0.31 answers it
(tokens and the first token come from the simulated engine's deterministic model,
pd_router_dev.sim.model, so a disaggregated answer can be compared with a direct one). Everything after that is LMCache's: for the request id the
router put into `kv_transfer_params.disagg_spec`, one sender per TP rank (worker_id = rank) builds
the DisaggSpec as vLLM's LMCacheConnectorV1 does, asks the receiver of its rank for buffer slots
over ZMQ, writes the chunks with NIXL and, when all landed, PUSHes a ProxyNotif to `pd_proxy_host:
pd_proxy_port` (the router, or the notification sidecar). The receivers (one per decoder TP rank)
bind the decoder's init/alloc ports. GET /harness/received?req_id=X says which chunks arrived
intact.

The sender and receiver configs are the chart's rendered LMCache ConfigMaps, loaded by LMCache's
own loader, with only what a CPU machine with free ports needs changed: pd_buffer_device cpu, a
small pd_buffer_size, the ports and the proxy address (config.json: "overrides").
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import yaml
from aiohttp import web
from lmcache.integration.vllm.vllm_v1_adapter import DisaggSpec
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.pd_backend_async import PDBackendAsync

_ROUTER = Path(__file__).resolve().parents[3] / "router"
# this runs under the engine stack's Python, which has neither package installed
sys.path[:0] = [str(_ROUTER / "src"), str(_ROUTER / "dev" / "src")]
from pd_router_dev.sim import model as M  # noqa: E402

HEADS, HEAD_DIM, DTYPE = 1, 8, torch.float16


def load_config(rendered: str, overrides: dict[str, Any]) -> LMCacheEngineConfig:
    data = {**yaml.safe_load(rendered), **overrides}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    cfg = LMCacheEngineConfig.from_file(f.name)
    os.unlink(f.name)
    return cfg.validate()


class Prefiller:
    def __init__(self, conf: dict[str, Any]) -> None:
        self.conf = conf
        self.tp = int(conf["tp"])
        self.model = conf["model"]
        sender_cfg = load_config(conf["sender_yaml"], conf["sender_overrides"])
        receiver_cfg = load_config(conf["receiver_yaml"], conf["receiver_overrides"])
        self.chunk = sender_cfg.chunk_size
        self.receivers = [PDBackendAsync(receiver_cfg, self.meta(r)) for r in range(self.tp)]
        self.senders = [PDBackendAsync(sender_cfg, self.meta(r)) for r in range(self.tp)]
        self.expected: dict[str, list[tuple[int, CacheEngineKey, float]]] = {}

    def meta(self, rank: int) -> LMCacheMetadata:
        return LMCacheMetadata(
            model_name=self.model,
            world_size=self.tp,
            local_world_size=self.tp,
            worker_id=rank,
            local_worker_id=rank,
            kv_dtype=DTYPE,
            kv_shape=(1, 2, self.chunk, HEADS, HEAD_DIM),
        )

    def push(self, spec: dict[str, Any], prompt: list[int]) -> None:
        """What the LMCache connector does after a prefill, per TP rank (blocking: the first
        request to a receiver waits for the NIXL handshake)."""
        req_id = spec["req_id"]
        n_chunks = math.ceil(len(prompt) / self.chunk)
        expected = self.expected.setdefault(req_id, [])
        for rank, sender in enumerate(self.senders):
            disagg = DisaggSpec(  # as LMCacheConnectorV1 builds it from kv_transfer_params
                req_id=req_id,
                receiver_id=spec["receiver_host"] + str(spec["receiver_init_port"]),
                receiver_host=spec["receiver_host"],
                receiver_init_port=spec["receiver_init_port"],
                receiver_alloc_port=spec["receiver_alloc_port"],
                is_last_prefill=True,
                total_chunks=n_chunks,
            )
            keys, objs = [], []
            for i in range(n_chunks):
                tokens = min(self.chunk, len(prompt) - i * self.chunk)
                obj = sender.allocate(torch.Size((1, 2, tokens, HEADS, HEAD_DIM)), DTYPE, fmt=MemoryFormat.KV_2LTD)
                assert obj is not None, "sender buffer full"
                fill = float((hash((req_id, rank, i)) % 1000) + 1)
                obj.tensor.fill_(fill)
                key = CacheEngineKey(self.model, self.tp, rank, M.seq_hash(prompt[: i * self.chunk + tokens]), DTYPE)
                keys.append(key)
                objs.append(obj)
                expected.append((rank, key, fill))
            sender.batched_submit_put_task(keys, objs, transfer_spec=disagg)
            for obj in objs:
                obj.ref_count_down()  # the connector's reference; the transfer task holds its own

    def received(self, req_id: str) -> dict[str, int]:
        expected = self.expected.get(req_id, [])
        present = intact = 0
        for rank, key, fill in expected:
            backend = self.receivers[rank]
            with backend.data_lock:
                obj = backend.data.get(key)
                if obj is not None:
                    present += 1
                    intact += int(bool(torch.all(obj.tensor == fill)))
        return {"expected": len(expected), "present": present, "intact": intact}


def build_app(pre: Prefiller) -> web.Application:
    app = web.Application()
    max_len = int(pre.conf["max_model_len"])

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            toks = M.apply_chat_template(body["messages"], bool(body.get("add_generation_prompt", True)))
        else:
            toks = M.tokenize_text(body["prompt"], bool(body.get("add_special_tokens", True)))
        return web.json_response({"count": len(toks), "max_model_len": max_len, "tokens": toks, "token_strs": None})

    async def completions(request: web.Request) -> web.Response:
        return await prefill_leg(await request.json(), False)

    async def chat(request: web.Request) -> web.Response:
        return await prefill_leg(await request.json(), True)

    async def prefill_leg(body: dict[str, Any], chat: bool) -> web.Response:
        if chat:
            prompt = M.apply_chat_template(body["messages"], bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            prompt = M.tokenize_text(body["prompt"], bool(body.get("add_special_tokens", True)))
        else:
            prompt = body.get("prompt")
        ids_asked = bool(body.get("return_token_ids"))
        spec = (body.get("kv_transfer_params") or {}).get("disagg_spec")
        if not isinstance(prompt, list) or spec is None or body.get("max_tokens") != 1:
            return web.json_response(
                {
                    "error": {
                        "message": "only LMCache prefill legs",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                status=400,
            )
        tok = M.Generator(prompt, bool(body.get("ignore_eos"))).step(bool(body.get("min_tokens")))
        if not pre.conf.get("silent"):
            await asyncio.to_thread(pre.push, spec, prompt)
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": M.token_text(tok), "reasoning": None}
        else:
            choice["text"] = M.token_text(tok)
        choice.update(
            logprobs=None,
            finish_reason="stop" if tok == M.EOS else "length",
            stop_reason=None,
            token_ids=[tok] if ids_asked else None,
        )
        answer: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": pre.model,
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "kv_transfer_params": {"first_tok": tok},
        }
        ids = prompt if ids_asked else None
        if chat:  # ChatCompletionResponse.prompt_token_ids; CompletionResponseChoice's otherwise
            answer["prompt_token_ids"] = ids
        else:
            choice.update(prompt_logprobs=None, prompt_token_ids=ids)
        return web.json_response(answer)

    async def received(request: web.Request) -> web.Response:
        return web.json_response(pre.received(request.query["req_id"]))

    async def requests(_: web.Request) -> web.Response:
        return web.json_response(sorted(pre.expected))

    app.router.add_get("/health", health)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/harness/received", received)
    app.router.add_get("/harness/requests", requests)
    return app


async def serve(conf: dict[str, Any]) -> None:
    pre = Prefiller(conf)
    runner = web.AppRunner(build_app(pre), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tmp = conf["port_file"] + ".tmp"
    Path(tmp).write_text(str(port))
    os.replace(tmp, conf["port_file"])
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(serve(json.load(sys.stdin)))
    finally:
        os._exit(0)  # LMCache's daemon threads and NIXL agents need no orderly shutdown here
