"""Simulated vLLM engine: an aiohttp server with vLLM's OpenAI surface, timing model,
both KV hand-off protocols and fault switches.

Shapes checked against vLLM v0.11 (``vllm/entrypoints/openai/protocol.py``): SSE chunks
``chat.completion.chunk`` / ``text_completion`` ending in ``data: [DONE]``, top-level
``kv_transfer_params`` in completion responses, ``POST /tokenize`` returning
``{count, max_model_len, tokens, token_strs}``, error body ``{object: "error", message,
type, param, code}``. Metric names from vLLM's v1 Prometheus logger (``vllm:...``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson
import zmq
import zmq.asyncio
from aiohttp import web

from pd_router.devstack import write_port_file
from pd_router.lmcache_wire import encode_notif
from pd_router.sim import model as M

FAULTS = (
    "none",
    "error",
    "hang",
    "slow",
    "unhealthy",
    "no_notify",
    "bad_request",
    "stall",
    "tokenize_error",
    "hang_after_headers",
)


@dataclass
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "llama-3.3-70b"
    max_model_len: int = 32768
    kv_connector: str = "none"  # none | nixl | lmcache
    lmcache_role: str = "sender"  # sender | receiver
    pd_proxy_host: str = "127.0.0.1"
    pd_proxy_port: int = 7500
    tp: int = 1
    pd_peer_host: str = "127.0.0.1"
    pd_peer_init_port: list[int] = field(default_factory=lambda: [7300])
    pd_peer_alloc_port: list[int] = field(default_factory=lambda: [7400])
    prefill_ms_per_token: float = 0.0
    decode_step_ms: float = 0.0
    decode_step_ms_per_seq: float = 0.0
    transfer_ms: float = 0.0
    slow_factor: float = 20.0
    fault: str = "none"
    engine_id: str = ""


def _err(status: int, message: str, etype: str = "BadRequestError") -> web.Response:
    body = {"object": "error", "message": message, "type": etype, "param": None, "code": status}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class BadRequest(Exception):
    pass


class Seq:
    __slots__ = (
        "cancelled",
        "done",
        "gen",
        "max_tokens",
        "min_tokens",
        "n_out",
        "queue",
        "scheduled",
        "uncached",
    )

    def __init__(
        self, gen: M.Generator, max_tokens: int, uncached: int, min_tokens: int = 0
    ) -> None:
        self.gen = gen
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.uncached = uncached
        self.n_out = 0
        self.done = False
        self.cancelled = False
        self.scheduled = False
        self.queue: asyncio.Queue[int] = asyncio.Queue()

    def emit(self) -> None:
        tok = self.gen.step(self.n_out < self.min_tokens)
        self.n_out += 1
        if tok == M.EOS or self.n_out >= self.max_tokens:
            self.done = True
        self.queue.put_nowait(tok)


class Engine:
    """Step scheduler: one prefill per step (stalls every running decode), else a decode step
    whose duration grows with the batch size."""

    def __init__(self, cfg: SimConfig, state: dict[str, Any]) -> None:
        self.cfg = cfg
        self.state = state
        self.prefill_q: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def zero_delay(self) -> bool:
        c = self.cfg
        return (
            c.prefill_ms_per_token == 0
            and c.decode_step_ms == 0
            and c.decode_step_ms_per_seq == 0
            and self.state["fault"] != "slow"
        )

    def _factor(self) -> float:
        return self.cfg.slow_factor if self.state["fault"] == "slow" else 1.0

    def submit(self, seq: Seq) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        self.prefill_q.append(seq)
        self.wake.set()

    async def _run(self) -> None:
        c = self.cfg
        while True:
            if not self.prefill_q and not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            f = self._factor()
            if self.prefill_q:
                seq = self.prefill_q.popleft()
                if seq.cancelled:
                    continue
                await asyncio.sleep(c.prefill_ms_per_token * max(seq.uncached, 1) * f / 1000)
                seq.emit()
                if not seq.done:
                    self.running.append(seq)
                continue
            batch = len(self.running)
            await asyncio.sleep((c.decode_step_ms + c.decode_step_ms_per_seq * batch) * f / 1000)
            keep = []
            for seq in self.running:
                if seq.cancelled:
                    continue
                seq.emit()
                if not seq.done:
                    keep.append(seq)
            self.running = keep


class SimEngine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.engine_id = cfg.engine_id or uuid.uuid4().hex[:12]
        self.state: dict[str, Any] = {"fault": cfg.fault, "fault_count": -1}
        self.engine = Engine(cfg, self.state)
        self.requests: deque[dict[str, Any]] = deque(maxlen=200)
        self.kv_store: OrderedDict[int, int] = OrderedDict()  # prefix hash -> n tokens
        self.handshaken: set[tuple[str, int]] = set()
        self.zctx: zmq.asyncio.Context | None = None
        self.push_socks: list[zmq.asyncio.Socket] = []
        self.bg: set[asyncio.Task[Any]] = set()
        self.servers: list[asyncio.AbstractServer] = []
        self.m: dict[str, float] = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "success": 0,
            "kv_hits": 0,
            "kv_misses": 0,
            "kv_remote_prefill": 0,
            "notifs_sent": 0,
            "transfer_failures": 0,
            "aborted": 0,
            "hanging": 0,
        }
        self.running_reqs = 0
        self.release = asyncio.Event()

    # ------------------------------------------------------------------ faults
    def _fault(self) -> str:
        f = self.state["fault"]
        if f != "none" and self.state["fault_count"] == 0:
            return "none"
        return f

    async def _hang(self) -> None:
        """Hang until the client goes away (the ``hang`` faults), counted while it lasts."""
        self.m["hanging"] += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.m["hanging"] -= 1

    def _consume_fault(self) -> None:
        if self.state["fault_count"] > 0:
            self.state["fault_count"] -= 1

    # ------------------------------------------------------------------ handlers
    async def health(self, request: web.Request) -> web.Response:
        if self.state["fault"] == "unhealthy":
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        data = {
            "object": "list",
            "data": [
                {
                    "id": self.cfg.model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": self.cfg.model,
                    "max_model_len": self.cfg.max_model_len,
                }
            ],
        }
        return web.json_response(data)

    async def tokenize(self, request: web.Request) -> web.Response:
        if self.state["fault"] == "tokenize_error":
            return _err(500, "simulated tokenizer failure", "InternalServerError")
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            if "messages" in body:
                toks = M.apply_chat_template(
                    body["messages"], bool(body.get("add_generation_prompt", True))
                )
            elif isinstance(body.get("prompt"), str):
                toks = M.tokenize_text(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise BadRequest("either 'prompt' (string) or 'messages' is required")
        except (orjson.JSONDecodeError, BadRequest, ValueError) as exc:
            return _err(400, str(exc))
        out = {
            "count": len(toks),
            "max_model_len": self.cfg.max_model_len,
            "tokens": toks,
            "token_strs": None,
        }
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def sim_fault(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode = body.get("mode", "none")
        if mode not in FAULTS:
            return _err(400, f"unknown fault {mode!r}")
        self.state["fault"] = mode
        self.state["fault_count"] = int(body.get("count", -1))
        return web.json_response({"fault": mode, "count": self.state["fault_count"]})

    async def sim_release(self, request: web.Request) -> web.Response:
        """Release streams held by the ``stall`` fault (and clear the fault)."""
        self.state["fault"] = "none"
        self.release.set()
        self.release = asyncio.Event()
        return web.json_response({"released": True})

    async def sim_requests(self, request: web.Request) -> web.Response:
        out = list(self.requests)
        if request.query.get("clear"):
            self.requests.clear()
        return web.json_response(out)

    async def metrics(self, request: web.Request) -> web.Response:
        name = self.cfg.model
        lab = f'{{model_name="{name}",engine="0"}}'
        running = self.running_reqs if self.engine.zero_delay else len(self.engine.running)
        waiting = len(self.engine.prefill_q)
        m = self.m
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{lab} {running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{lab} {waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{lab} {min(1.0, len(self.kv_store) / 4096):.4f}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{lab} {m['prompt_tokens']}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{lab} {m['generation_tokens']}",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{lab} {m['success']}",
            "# TYPE pd_sim_kv_hits_total counter",
            f"pd_sim_kv_hits_total {m['kv_hits']}",
            "# TYPE pd_sim_kv_misses_total counter",
            f"pd_sim_kv_misses_total {m['kv_misses']}",
            "# TYPE pd_sim_kv_remote_prefill_total counter",
            f"pd_sim_kv_remote_prefill_total {m['kv_remote_prefill']}",
            "# TYPE pd_sim_notifications_sent_total counter",
            f"pd_sim_notifications_sent_total {m['notifs_sent']}",
            "# TYPE pd_sim_transfer_failures_total counter",
            f"pd_sim_transfer_failures_total {m['transfer_failures']}",
            "# TYPE pd_sim_aborted_total counter",
            f"pd_sim_aborted_total {m['aborted']}",
            "# TYPE pd_sim_requests_hanging gauge",
            f"pd_sim_requests_hanging {m['hanging']}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            return await self._generate_one(request, chat)
        except (asyncio.CancelledError, ConnectionResetError):
            self.m["aborted"] += 1  # the client went away: vLLM aborts the request
            raise

    # ------------------------------------------------------------------ generation
    def _parse(self, body: Any, chat: bool) -> tuple[list[int], int, bool, bool, int]:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        mdl = body.get("model")
        if mdl is not None and mdl != self.cfg.model:
            raise LookupError(f"The model `{mdl}` does not exist.")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean")
        if chat:
            prompt = M.apply_chat_template(body.get("messages"))
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
                p = p[0]
            if isinstance(p, str):
                prompt = M.tokenize_text(p)
            elif (
                isinstance(p, list)
                and p
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            ):
                prompt = list(p)
            else:
                raise BadRequest("'prompt' must be a string or a non-empty list of token ids")
        mt = body.get("max_completion_tokens") if chat else None
        if mt is None:
            mt = body.get("max_tokens")
        if mt is None:
            # vLLM v0.11 defaults: CompletionRequest.max_tokens = 16; chat = what fits in the
            # context (get_max_tokens, no generation_config limit modelled here)
            mt = 16 if not chat else max(1, self.cfg.max_model_len - len(prompt))
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise BadRequest("max_tokens must be at least 1")
        min_tokens = body.get("min_tokens", 0)
        if min_tokens is None:
            min_tokens = 0
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise BadRequest(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if min_tokens > mt:  # vLLM SamplingParams._verify_args
            raise BadRequest(
                f"min_tokens must be less than or equal to max_tokens={mt}, got {min_tokens}."
            )
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("the simulated engine supports only n=1")
        temp = body.get("temperature")
        if temp is not None and (not isinstance(temp, int | float) or temp < 0):
            raise BadRequest("temperature must be a non-negative number")
        if len(prompt) + mt > self.cfg.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. "
                f"However, you requested {len(prompt) + mt} tokens "
                f"({len(prompt)} in the messages, {mt} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadRequest("ignore_eos must be a boolean")
        return prompt, mt, stream, ignore_eos, min_tokens

    async def _generate_one(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        fault = self._fault()
        if fault in ("error", "hang", "bad_request"):
            self._consume_fault()
            if fault == "error":
                return _err(503, "simulated engine failure", "ServiceUnavailableError")
            if fault == "bad_request":
                return _err(400, "simulated bad request")
            await self._hang()
        try:
            body = orjson.loads(raw)
            prompt, max_tokens, stream, ignore_eos, min_tokens = self._parse(body, chat)
        except LookupError as exc:
            return _err(404, str(exc.args[0]), "NotFoundError")
        except (orjson.JSONDecodeError, BadRequest, ValueError, TypeError) as exc:
            return _err(400, str(exc))
        self.requests.append(
            {
                "path": request.path,
                "x_request_id": request.headers.get("X-Request-Id"),
                "authorization": request.headers.get("Authorization"),
                "body": body,
            }
        )
        kv = body.get("kv_transfer_params")
        kv_out: dict[str, Any] | None = None
        uncached = len(prompt)
        lmcache_spec: dict[str, Any] | None = None
        if isinstance(kv, dict):
            if kv.get("do_remote_decode"):
                # NIXL prefill leg: compute the prompt, keep the blocks for the decoder.
                max_tokens = 1
                rid = f"cmpl-{uuid.uuid4().hex}"
                kv_out = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": list(range((len(prompt) + 15) // 16)),
                    "remote_engine_id": self.engine_id,
                    "remote_request_id": rid,
                    "remote_host": self.cfg.host,
                    "remote_port": 5600,
                    "tp_size": self.cfg.tp,
                }
            elif kv.get("do_remote_prefill"):
                if kv.get("remote_block_ids") and kv.get("remote_engine_id"):
                    uncached = 1
                    self.m["kv_remote_prefill"] += 1
            elif "disagg_spec" in kv and self.cfg.kv_connector == "lmcache":
                lmcache_spec = kv["disagg_spec"] if isinstance(kv["disagg_spec"], dict) else None
                max_tokens = 1
        if self.cfg.kv_connector == "lmcache" and self.cfg.lmcache_role == "receiver":
            key = M.seq_hash(prompt[:-1])
            if key in self.kv_store:
                uncached = 1
                self.m["kv_hits"] += 1
            else:
                self.m["kv_misses"] += 1
        if fault == "slow":
            self._consume_fault()
        self.m["prompt_tokens"] += len(prompt)
        seq = Seq(M.Generator(prompt, ignore_eos), max_tokens, uncached, min_tokens)
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.running_reqs += 1
        try:
            if not stream:
                toks = await self._collect(seq)
                if lmcache_spec is not None:
                    kv_out = {"first_tok": toks[0]}
                    self._spawn(self._lmcache_send(lmcache_spec, prompt, toks[0]))
                resp = self._full_response(chat, rid, created, prompt, toks, max_tokens, kv_out)
                self.m["success"] += 1
                return web.Response(body=orjson.dumps(resp), content_type="application/json")
            return await self._stream(request, chat, rid, created, prompt, seq, body)
        finally:
            self.running_reqs -= 1
            seq.cancelled = True

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.bg.add(t)
        t.add_done_callback(self.bg.discard)

    async def _next_tokens(self, seq: Seq) -> list[int]:
        """Next batch of tokens (zero-delay engines produce everything at once)."""
        if not seq.scheduled and self.engine.zero_delay and self.state["fault"] != "stall":
            out = []
            while not seq.done:
                seq.emit()
                out.append(seq.queue.get_nowait())
            return out
        if not seq.scheduled:
            seq.scheduled = True
            self.engine.submit(seq)
        return [await seq.queue.get()]

    async def _collect(self, seq: Seq) -> list[int]:
        toks: list[int] = []
        while True:
            toks.extend(await self._next_tokens(seq))
            if seq.done and seq.queue.empty():
                return toks

    def _finish(self, toks: list[int], max_tokens: int) -> str:
        return "stop" if toks and toks[-1] == M.EOS else "length"

    def _full_response(
        self,
        chat: bool,
        rid: str,
        created: int,
        prompt: list[int],
        toks: list[int],
        max_tokens: int,
        kv_out: dict[str, Any] | None,
    ) -> dict[str, Any]:
        text = "".join(M.token_text(t) for t in toks)
        finish = self._finish(toks, max_tokens)
        self.m["generation_tokens"] += len(toks)
        usage = {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(toks),
            "completion_tokens": len(toks),
            "prompt_tokens_details": None,
        }
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.cfg.model,
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": kv_out,
        }

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        rid: str,
        created: int,
        prompt: list[int],
        seq: Seq,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)  # headers go out at once, like vLLM
        if self._fault() == "hang_after_headers":
            self._consume_fault()
            await self._hang()
        model = self.cfg.model
        obj = "chat.completion.chunk" if chat else "text_completion"
        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        role_chunk = b""
        if chat:
            # vLLM v0.11 sends the role chunk with the first output, i.e. after the prefill
            first = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            role_chunk = b"data: " + orjson.dumps(first) + b"\n\n"
        n = 0
        while True:
            toks = await self._next_tokens(seq)
            buf = [role_chunk] if role_chunk else []
            role_chunk = b""
            for i, tok in enumerate(toks):
                n += 1
                last = seq.done and seq.queue.empty() and i == len(toks) - 1
                finish = ("stop" if tok == M.EOS else "length") if last else None
                text = M.token_text(tok)
                if chat:
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": {"content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                else:
                    choice = {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                chunk = {"id": rid, "object": obj, "created": created, "model": model}
                chunk["choices"] = [choice]
                buf.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"".join(buf))
            if self.state["fault"] == "stall":
                # hold the stream after the first tokens until POST /sim/release
                await self.release.wait()
            if seq.done and seq.queue.empty():
                break
        self.m["generation_tokens"] += n
        tail = b""
        if include_usage:
            usage_chunk = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "total_tokens": len(prompt) + n,
                    "completion_tokens": n,
                },
            }
            tail = b"data: " + orjson.dumps(usage_chunk) + b"\n\n"
        await resp.write(tail + b"data: [DONE]\n\n")
        self.m["success"] += 1
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ LMCache roles
    async def _lmcache_send(self, spec: dict[str, Any], prompt: list[int], first: int) -> None:
        """Sender (prefiller) side: push the KV to the receiver's ports, then one ProxyNotif
        per TP rank to the proxy. A failed transfer sends no notification (as LMCache)."""
        req_id = spec.get("req_id")
        try:
            host = str(spec["receiver_host"])
            init_ports = list(spec["receiver_init_port"])
            alloc_ports = list(spec["receiver_alloc_port"])
            if self.cfg.transfer_ms:
                await asyncio.sleep(self.cfg.transfer_ms / 1000)
            line = json.dumps(
                {"req_id": req_id, "prefix_hash": M.seq_hash(prompt), "n": len(prompt)}
            ).encode()
            for rank in range(self.cfg.tp):
                ip, ap = int(init_ports[rank]), int(alloc_ports[rank])
                if (host, ip) not in self.handshaken:
                    await self._line_call(host, ip, b'{"hello": 1}')
                    self.handshaken.add((host, ip))
                await self._line_call(host, ap, line)
        except Exception:
            self.m["transfer_failures"] += 1
            return
        if self._fault() == "no_notify" or not isinstance(req_id, str):
            return
        if not self.push_socks:
            self.zctx = zmq.asyncio.Context()
            for _ in range(self.cfg.tp):
                s = self.zctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://{self.cfg.pd_proxy_host}:{self.cfg.pd_proxy_port}")
                self.push_socks.append(s)
        msg = encode_notif(req_id)
        for s in self.push_socks:
            await s.send(msg)
            self.m["notifs_sent"] += 1

    async def _line_call(self, host: str, port: int, line: bytes) -> None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        try:
            writer.write(line + b"\n")
            await writer.drain()
            reply = await asyncio.wait_for(reader.readline(), 5)
            if not reply.startswith(b"OK"):
                raise ConnectionError(f"receiver answered {reply!r}")
        finally:
            writer.close()

    async def _receiver_conn(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                if "prefix_hash" in msg:
                    self.kv_store[int(msg["prefix_hash"])] = int(msg.get("n", 0))
                    while len(self.kv_store) > 4096:
                        self.kv_store.popitem(last=False)
                writer.write(b"OK\n")
                await writer.drain()
        except (ValueError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start_receiver(self) -> None:
        if self.cfg.kv_connector != "lmcache" or self.cfg.lmcache_role != "receiver":
            return
        for port in [*self.cfg.pd_peer_init_port, *self.cfg.pd_peer_alloc_port]:
            srv = await asyncio.start_server(
                self._receiver_conn, self.cfg.pd_peer_host, port, backlog=4096
            )
            self.servers.append(srv)

    async def close(self) -> None:
        for s in self.servers:
            s.close()
        for t in list(self.bg):
            t.cancel()
        for s in self.push_socks:
            s.close(0)
        if self.zctx is not None:
            self.zctx.term()


def build_app(cfg: SimConfig) -> tuple[web.Application, SimEngine]:
    sim = SimEngine(cfg)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", sim.health)
    app.router.add_get("/v1/models", sim.models)
    app.router.add_post("/tokenize", sim.tokenize)
    app.router.add_post("/v1/completions", sim.completions)
    app.router.add_post("/v1/chat/completions", sim.chat)
    app.router.add_get("/metrics", sim.metrics)
    app.router.add_post("/sim/fault", sim.sim_fault)
    app.router.add_get("/sim/requests", sim.sim_requests)
    app.router.add_post("/sim/release", sim.sim_release)

    async def on_startup(_: web.Application) -> None:
        await sim.start_receiver()

    async def on_cleanup(_: web.Application) -> None:
        await sim.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app, sim


async def serve(cfg: SimConfig, port_file: str | None = None) -> None:
    app, _sim = build_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=2048, reuse_address=True)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    write_port_file(port_file, port)
    print(f"pd-sim-engine listening on {cfg.host}:{port} model={cfg.model}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
