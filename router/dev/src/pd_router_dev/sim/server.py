"""Simulated vLLM engine: an aiohttp server with vLLM's OpenAI surface, vLLM V1's scheduler
timing, both KV hand-off protocols and fault switches.

It follows vLLM 0.31.0 (the version in the engine image ``lmcache/vllm-openai:v0.5.6``);
``--vllm-version 0.33`` switches to 0.33.0's prompt-length rule (only the prompt must fit
``max_model_len``; the output is clamped to what fits) and NIXL metrics. Every rule cites
the vLLM file it was checked against (paths relative to the ``vllm/`` package):

- request validation, error bodies and length rules: ``protocol.py`` of this package;
- responses: ``entrypoints/openai/{completion,chat_completion}/{protocol,serving}.py`` --
  ``n`` choices (each its own ``index``, streamed chunk by chunk per index, usage counting
  all), ``stop``/``stop_token_ids``/``include_stop_str_in_output`` with ``stop_reason``,
  ``system_fingerprint``, SSE ending in ``data: [DONE]``, ``stream_options.include_usage``
  and ``continuous_usage_stats``; ids are ``cmpl-``/``chatcmpl-`` + ``X-Request-Id`` (or
  the body's ``request_id``) as vLLM's ``_base_request_id``;
- ``GET /v1/models``: ``ModelList``/``ModelCard``/``ModelPermission``
  (``entrypoints/serve/engine/protocol.py``); ``POST /tokenize`` returns
  ``{count, max_model_len, tokens, token_strs}``, ``POST /detokenize`` ``{prompt}``
  (``entrypoints/serve/tokenize/protocol.py``); a path it lacks is FastAPI's 404
  ``{"detail": "Not Found"}``, a known path under another method 405 ``{"detail": "Method
  Not Allowed"}`` with ``Allow`` (vLLM registers no handler for Starlette's own HTTP
  errors: ``entrypoints/serve/exception_handling/register.py``);
- ``GET /metrics``: ``vllm:*`` as ``v1/metrics/loggers.py`` exports them (``metrics.py``),
  plus the simulator's own ``pd_sim_*`` counters;
- scheduling and timing: ``engine.py`` (``v1/core/sched/scheduler.py``, chunked prefill
  with ``max_num_batched_tokens``);
- automatic prefix caching: ``engine.py`` ``PrefixCache`` (``v1/core/kv_cache_manager.py``,
  ``block_pool.py``, ``kv_cache_utils.py``): a pool of ``--prefix-cache-tokens`` / 16 blocks
  per engine (0 = ``--no-enable-prefix-caching``), full blocks hashed in a chain, the longest
  cached prefix reused at admission (never the prompt's last token) and only the rest
  computed, LRU eviction with a finished request's tail blocks first,
  ``vllm:prefix_cache_queries``/``vllm:prefix_cache_hits``; KV a connector delivered (NIXL,
  LMCache) is cached on the decoder too; ``GET /sim/prefix_cache`` (simulator only) shows
  the pool;
- NIXL prefill answers carry the ``kv_transfer_params`` of ``NixlConnector``'s
  ``request_finished`` (``distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``).

``logprobs`` (chat's ``logprobs``/``top_logprobs``, completions' ``logprobs``) come back in
vLLM's shapes with figures of the simulator's own (``model.top_logprobs``: the sampled token
the likeliest), the limits vLLM puts on them refused in its words (``protocol.py``).

It is an engine started with vLLM's defaults otherwise: text only (media in ``messages``
refused), no ``--enable-prompt-embeds`` (``prompt_embeds`` refused), no tool parser (a
``tool_choice`` other than none refused), each in vLLM's words. Beam search is accepted with
its own rules (no sampling checks; not streamed), its beams being ``n`` choices of their own.

Not modelled (each probed against vLLM in tests/real_engine/test_real_sim_differential.py
``GAPS``, or named there with why it is not): sampling itself (output is a deterministic hash
of the sequence; ``n`` choices differ by a per-index seed, temperature/top_p/... are
validated but change nothing), ``prompt_logprobs`` and ``logprob_token_ids``, echo, reasoning
parsers, structured outputs, ``truncate_prompt_tokens``, the tools' own pydantic model, LoRA
adapters' weights (an adapter answers with other weights of its own), the tokenizer's
character-length pre-check, pydantic's exact wording for malformed chat ``messages``, KV
cache capacity and preemption, ``cache_salt``, the NIXL prefiller's
``remote_prefill_cached_tokens`` in its ``kv_transfer_params``, and any 0.33 response-shape
change other than the length rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson
import zmq
import zmq.asyncio
from aiohttp import web

from pd_router.handoff.lmcache_wire import encode_notif
from pd_router.serving import write_port_file
from pd_router_dev.sim import model as M
from pd_router_dev.sim import protocol as P
from pd_router_dev.sim.engine import (
    BLOCK_SIZE,
    Engine,
    Event,
    PrefixCache,
    Run,
    Seq,
    block_hashes,
)
from pd_router_dev.sim.kv_events import Publisher as KvPublisher
from pd_router_dev.sim.kv_events import parse_config as parse_kv_events
from pd_router_dev.sim.metrics import KV_BYTES_PER_TOKEN, VllmMetrics

FAULTS = (
    "none",
    "error",
    "kv_load_fail",
    "hang",
    "slow",
    "unhealthy",
    "no_notify",
    "bad_request",
    "stall",
    "tokenize_error",
    "hang_after_headers",
)
_MASK64 = (1 << 64) - 1
REQUESTS_KEPT = 200  # /sim/requests: the last requests' records, for tests
NUM_LAYERS = 80


@dataclass
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "llama-3.3-70b"
    # further served names (vLLM ``--served-model-name A B ...``: every name is accepted and
    # listed in /v1/models, the first is the one answers carry; serve/engine/serving.py 0.31)
    aliases: tuple[str, ...] = ()
    # LoRA adapters (vLLM --lora-modules, the served model their base): accepted in ``model``,
    # listed in /v1/models with ``parent``, answers of their own (other "weights") that carry
    # the adapter's name (entrypoints/openai/models/serving.py, 0.31.0)
    lora_modules: tuple[str, ...] = ()
    lora_roots: tuple[str, ...] = ()  # each adapter's path (its card's ``root``)
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
    # other weights under the same name (0: the model's own): every greedy answer differs, as a
    # pod that loaded another upstream commit under one revision (pd_router.weights)
    weights_seed: int = 0
    vllm_version: str = "0.31"  # 0.31 | 0.33
    # engine/arg_utils.py (0.31) get_batch_defaults: an OpenAI API server on a >= 70 GiB GPU
    # that is not an A100 (H100/H200) defaults to 8192 batched tokens and 1024 sequences
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    num_gpu_blocks: int = 8192  # vLLM's --num-gpu-blocks-override; profiled on a real GPU
    step_time: str = "sum"  # sum | max: how a step's duration is modelled (engine.py)
    # vLLM's automatic prefix caching (on by default, engine/arg_utils.py 0.31): the tokens
    # of KV its block pool holds (16 per block, engine.py PrefixCache); 0 = off
    prefix_cache_tokens: int = 262144
    # vLLM's --kv-events-config (JSON; sim/kv_events.py): "" = off, as vLLM's default
    kv_events_config: str = ""


def random_uuid() -> str:
    # vllm/utils/__init__.py (0.31) random_uuid: 16 hex characters
    return f"{uuid.uuid4().int & _MASK64:016x}"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _error(exc: P.ApiError) -> web.Response:
    return _json(exc.body(), exc.status)


def _err(status: int, message: str, etype: str = "BadRequestError") -> web.Response:
    return _error(P.ApiError(status, message, etype))


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _logprob(tok: int, lp: float) -> dict[str, Any]:
    text = M.token_text(tok)
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def _logprobs(
    req: P.Request, pairs: list[tuple[int, int]], offset: int
) -> tuple[dict[str, Any] | None, int]:
    """The ``logprobs`` of a choice's tokens ((token, state) pairs; None when not asked) and
    the text offset after them. Chat (chat_completion/serving.py _create_chat_logprobs, 0.31):
    ``content``, each token with its ``top_logprobs`` (``top_logprobs`` of them, 0: none).
    Completions (completion/serving.py _create_completion_logprobs): ``text_offset`` (from
    ``offset``, the choice's text before them), ``token_logprobs``, ``tokens`` and
    ``top_logprobs``, each a dict of the sampled token and the next likeliest, ``logprobs``
    entries at least one. Figures from model.top_logprobs."""
    k = req.logprobs
    if k is None:
        return None, offset
    if req.chat:
        content = []
        for tok, state in pairs:
            top = M.top_logprobs(state, tok, max(k, 1))
            entry = _logprob(tok, top[0][1])
            entry["top_logprobs"] = [_logprob(t, lp) for t, lp in top[:k]]
            content.append(entry)
        return {"content": content}, offset
    out: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    for tok, state in pairs:
        top = M.top_logprobs(state, tok, max(k, 1))
        text = M.token_text(tok)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(top[0][1])
        out["tokens"].append(text)
        out["top_logprobs"].append({M.token_text(t): lp for t, lp in top})
        offset += len(text)
    return out, offset


def _drain(q: asyncio.Queue[Event]) -> list[Event]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


@dataclass
class Ctx:
    """What one generation request needs once validated."""

    req: P.Request
    rid: str
    created: int
    fingerprint: str
    lmcache_spec: dict[str, Any] | None = None
    nixl_prefill: bool = False


class SimEngine:
    def __init__(self, cfg: SimConfig) -> None:
        if cfg.vllm_version not in P.VERSIONS:
            raise ValueError(f"vllm_version must be one of {P.VERSIONS}")
        self.cfg = cfg
        # every name served: answers carry the first, or the adapter's
        self.names = (cfg.model, *cfg.aliases, *cfg.lora_modules)
        self.engine_id = cfg.engine_id or uuid.uuid4().hex[:12]
        self.state: dict[str, Any] = {"fault": cfg.fault, "fault_count": -1}
        caching = cfg.prefix_cache_tokens // BLOCK_SIZE > 1
        cache = {
            "block_size": str(BLOCK_SIZE),
            "effective_attention_block_size": str(BLOCK_SIZE),
            "enable_prefix_caching": str(caching),
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "num_gpu_blocks_override": str(cfg.num_gpu_blocks),
            "kv_cache_size_tokens": str(cfg.prefix_cache_tokens if caching else 0),
        }
        self.vm = VllmMetrics(
            cfg.model, cfg.max_model_len, cfg.kv_connector, cfg.vllm_version, cache
        )
        self.engine = Engine(cfg, self.state, self.vm)
        blocks = cfg.prefix_cache_tokens // BLOCK_SIZE
        self.prefix_cache = PrefixCache(blocks) if blocks > 1 else None
        self.kv_events: KvPublisher | None = None
        if cfg.kv_events_config:
            kc = parse_kv_events(cfg.kv_events_config)
            # vLLM publishes only with prefix caching on (block_pool.py: events come from it)
            if kc["enable_kv_cache_events"] and kc["publisher"] == "zmq" and self.prefix_cache:
                self.kv_events = KvPublisher(kc, BLOCK_SIZE)
                self.prefix_cache.events = self.kv_events
        self.requests: deque[dict[str, Any]] = deque(maxlen=REQUESTS_KEPT)
        self.kv_store: OrderedDict[int, int] = OrderedDict()  # prefix hash -> n tokens
        self.handshaken: set[tuple[str, int]] = set()
        self.zctx: zmq.asyncio.Context | None = None
        self.push_socks: list[zmq.asyncio.Socket] = []
        self.bg: set[asyncio.Task[Any]] = set()
        self.servers: list[asyncio.AbstractServer] = []
        self.m: dict[str, float] = {
            "kv_hits": 0,
            "kv_misses": 0,
            "kv_remote_prefill": 0,
            "notifs_sent": 0,
            "transfer_failures": 0,
            "aborted": 0,
            "health_checks": 0,
            "hanging": 0,
        }
        self.live: set[Run] = set()
        self.release = asyncio.Event()
        self.created = int(time.time())
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        """entrypoints/serve/utils/fingerprint.py (0.31), default ``full`` mode:
        ``vllm-<version>[-tp<N>]-<hash8>``, the hash standing in for vLLM's config hash."""
        c = self.cfg
        parts = [f"vllm-{P.FULL_VERSION[c.vllm_version]}"]
        if c.tp > 1:
            parts.append(f"tp{c.tp}")
        key = f"{c.model}|{c.max_model_len}|{c.kv_connector}|{c.max_num_batched_tokens}"
        parts.append(hashlib.sha256(key.encode()).hexdigest()[:8])
        return "-".join(parts)

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
        self.m["health_checks"] += 1
        if self.state["fault"] == "unhealthy":
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        # entrypoints/openai/models/serving.py (0.31) show_available_models: one card per
        # base model, ``root`` its path, one default ModelPermission
        # (entrypoints/serve/engine/protocol.py ModelCard / ModelPermission)
        now = int(time.time())
        cards = [self._card(name, now) for name in (self.cfg.model, *self.cfg.aliases)]
        roots = self.cfg.lora_roots or tuple(f"/adapters/{n}" for n in self.cfg.lora_modules)
        for name, root in zip(self.cfg.lora_modules, roots, strict=True):  # in load order
            card = self._card(name, now)
            card.update(root=root, parent=self.cfg.model, max_model_len=None)
            cards.append(card)
        return _json({"object": "list", "data": cards})

    def _card(self, name: str, now: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{random_uuid()}",
                    "object": "model_permission",
                    "created": now,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def tokenize(self, request: web.Request) -> web.Response:
        if self.state["fault"] == "tokenize_error":
            return _err(500, "simulated tokenizer failure", "InternalServerError")
        try:
            # serve/tokenize/api_router.py (0.31): the same JSON checks as generation
            raw = await request.read()
            body = P.require_object(P.decode_body(raw, request.headers.get("Content-Type", "")))
            mdl = body.get("model")
            if isinstance(mdl, str) and mdl and mdl not in self.names:
                raise P.not_found_model(mdl)  # serve/tokenize/serving.py: _check_model
            if "messages" in body:
                toks = M.apply_chat_template(
                    body["messages"], bool(body.get("add_generation_prompt", True))
                )
            elif isinstance(body.get("prompt"), str):
                toks = M.tokenize_text(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise P.ApiError(400, "either 'prompt' (string) or 'messages' is required")
        except P.ApiError as exc:
            return _error(exc)
        except ValueError as exc:
            return _err(400, str(exc))
        out = {
            "count": len(toks),
            "max_model_len": self.cfg.max_model_len,
            "tokens": toks,
            "token_strs": None,
        }
        return _json(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        """serve/tokenize/serving.py (0.31) create_detokenize: the model check, then the
        tokens' text (the toy tokenizer's output words; prompt words come back as ids)."""
        try:
            raw = await request.read()
            body = P.require_object(P.decode_body(raw, request.headers.get("Content-Type", "")))
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(P._is_tok(t) for t in toks):
                err = P.FieldError("list_type", ("tokens",), "Input should be a valid list", toks)
                if "tokens" not in body:
                    err = P.FieldError("missing", ("tokens",), "Field required", body)
                raise P.validation_error([err])
            mdl = body.get("model")
            if isinstance(mdl, str) and mdl and mdl not in self.names:
                raise P.not_found_model(mdl)
        except P.ApiError as exc:
            return _error(exc)
        return _json({"prompt": "".join(M.token_text(t) for t in toks)})

    async def not_found(self, request: web.Request) -> web.Response:
        """Starlette's answers for an unknown path (404) or method (405 with ``Allow``),
        rendered by FastAPI's default handler as ``{"detail": ...}``."""
        allowed: set[str] = set()
        this = request.match_info.route.resource
        for resource in request.app.router.resources():
            if resource is not this:
                match, methods = await resource.resolve(request)
                if match is None:
                    allowed |= methods - {"HEAD"}
        if allowed:
            return web.json_response(
                {"detail": "Method Not Allowed"},
                status=405,
                headers={"Allow": ", ".join(sorted(allowed))},
            )
        return web.json_response({"detail": "Not Found"}, status=404)

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

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """``GET /kv_event_sources`` (vLLM 0.31.0 serve/instrumentator/basic.py): the KV-event
        publisher's config by data-parallel rank, ``{}`` when there is none."""
        return _json(self.kv_events.sources() if self.kv_events is not None else {})

    async def sim_prefix_cache(self, request: web.Request) -> web.Response:
        """The prefix cache's block pool (a simulator-only view; vLLM has none)."""
        pc = self.prefix_cache
        return web.json_response({"enabled": pc is not None, **(pc.stats() if pc else {})})

    def _live_seqs(self) -> list[Seq]:
        if self.engine.zero_delay:
            # everything is instantaneous here: a sequence runs while its answer is sent
            return [s for r in self.live for s in r.seqs if not s.cancelled]
        return self.engine.running

    async def metrics(self, request: web.Request) -> web.Response:
        vm = self.vm
        live = self._live_seqs()
        vm.running.set(len(live))
        waiting = self.engine.num_waiting()
        vm.waiting.set(waiting)
        vm.waiting_capacity.set(waiting)
        blocks = sum(s.kv_blocks for s in live)
        vm.kv_usage.set(min(1.0, blocks / max(1, self.cfg.num_gpu_blocks)))
        m = self.m
        lines = [
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
            "# TYPE pd_sim_health_checks_total counter",
            f"pd_sim_health_checks_total {m['health_checks']}",
            "# TYPE pd_sim_requests_hanging gauge",
            f"pd_sim_requests_hanging {m['hanging']}",
            "# TYPE pd_sim_busy_seconds_total counter",
            f"pd_sim_busy_seconds_total {self.engine.busy_s}",
        ]
        text = vm.render() + ("\n".join(lines) + "\n").encode()
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

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
        c = self.cfg
        try:
            body = P.decode_body(raw, request.headers.get("Content-Type", ""))
            req = P.parse(body, chat, self.names, c.max_model_len, c.vllm_version)
        except P.ApiError as exc:
            return _error(exc)
        self.requests.append(
            {
                "path": request.path,
                "x_request_id": request.headers.get("X-Request-Id"),
                "authorization": request.headers.get("Authorization"),
                # W3C trace context as vLLM reads it (vllm/tracing.py TRACE_HEADERS)
                "traceparent": request.headers.get("traceparent"),
                "tracestate": request.headers.get("tracestate"),
                "body": body,
            }
        )
        if fault == "slow":
            self._consume_fault()
        # serve/engine/serving.py _base_request_id: the X-Request-Id header, else the body's
        # request_id, else a random id
        base = request.headers.get("X-Request-Id") or req.request_id or random_uuid()
        ctx = Ctx(
            req, ("chatcmpl-" if chat else "cmpl-") + base, int(time.time()), self.fingerprint
        )
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if fault == "kv_load_fail" and isinstance(kv, dict) and kv.get("do_remote_prefill"):
            self._consume_fault()
            return await self._kv_load_failed(request, ctx)
        err = P.start_error(req, M.VOCAB_SIZE)
        if err is not None:
            # raised once generation starts, so inside the stream when streaming
            # (create_streaming_error_response)
            if not req.stream:
                return _error(err)
            return await self._stream_error(request, err)
        run = self._start(ctx)
        self.live.add(run)
        try:
            if not req.stream:
                return await self._full(ctx, run)
            return await self._stream(request, ctx, run)
        finally:
            self.live.discard(run)
            run.cancel()

    def _start(self, ctx: Ctx) -> Run:
        """The request's sequences, with what its ``kv_transfer_params`` ask of this engine."""
        req = ctx.req
        c = self.cfg
        kv = req.kv_transfer_params
        run = Run(self.vm, req.n, self.prefix_cache, c.kv_connector != "none")
        for pi, prompt in enumerate(req.prompts):
            max_tokens = req.max_tokens[pi]
            uncached = len(prompt)
            if isinstance(kv, dict) and c.kv_connector == "nixl":
                if kv.get("do_remote_decode"):
                    # NIXL prefill leg: generates as asked (the router asks for 1 token),
                    # then keeps the blocks for the decoder; what goes back is built once
                    # the sequence finished (pull_scheduler.py request_finished)
                    ctx.nixl_prefill = True
                elif (
                    kv.get("do_remote_prefill")
                    and kv.get("remote_block_ids")
                    and kv.get("remote_engine_id")
                ):
                    uncached = 1
                    self.m["kv_remote_prefill"] += 1
                    # pull_scheduler.py update_state_after_alloc (0.31): only the blocks past
                    # the decoder's own prefix-cache hit are pulled
                    self._nixl_transfer(run, len(prompt) - self._local_hit(prompt))
            elif isinstance(kv, dict) and "disagg_spec" in kv and c.kv_connector == "lmcache":
                spec = kv["disagg_spec"]
                ctx.lmcache_spec = spec if isinstance(spec, dict) else None
                max_tokens = 1
            if c.kv_connector == "lmcache" and c.lmcache_role == "receiver":
                key = M.seq_hash(prompt[:-1])
                if key in self.kv_store:
                    uncached = 1
                    self.m["kv_hits"] += 1
                else:
                    self.m["kv_misses"] += 1
            # vllm:external_prefix_cache_* are counted at admission (engine.py Seq._admit),
            # past the local prefix-cache hit
            for j in range(req.n):
                Seq(
                    run,
                    pi * req.n + j,
                    pi,
                    prompt,
                    max_tokens,
                    c.max_model_len,
                    uncached,
                    min_tokens=req.min_tokens,
                    ignore_eos=req.ignore_eos,
                    stop=req.stop,
                    stop_token_ids=req.stop_token_ids,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    choice=j,
                    weights=c.weights_seed + _adapter_seed(req.model, c.lora_modules),
                )
        return run

    def _nixl_params(self, ctx: Ctx, seq: Seq) -> dict[str, Any]:
        """kv_connector/v1/nixl/pull_scheduler.py request_finished on the prefiller (0.31):
        block ids per KV-cache group (one group here) for the tokens computed (the prompt
        and all sampled tokens but the last), this engine's side channel
        (``VLLM_NIXL_SIDE_CHANNEL_PORT`` 5600, envs.py)."""
        computed = seq.prompt_len + seq.n_out - 1
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range((computed + BLOCK_SIZE - 1) // BLOCK_SIZE))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": ctx.rid,
            "remote_host": self.cfg.host,
            "remote_port": 5600,
            "tp_size": self.cfg.tp,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": computed,
            "remote_blocks_expiry_time": None,
        }
        if self.cfg.vllm_version == "0.33":
            out["remote_registration_generation"] = 0
        out["transfer_mode"] = "pull"
        return out

    def _local_hit(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this engine's prefix cache holds now (as admission finds them)."""
        pc = self.prefix_cache
        if pc is None:
            return 0
        return BLOCK_SIZE * len(pc.lookup(block_hashes(prompt), (len(prompt) - 1) // BLOCK_SIZE))

    def _nixl_transfer(self, run: Run, n_tokens: int) -> None:
        """The decoder pulls the prompt's KV (what its prefix cache lacks) before its first
        step: ``--transfer-ms`` of waiting, one transfer in the NIXL metrics."""
        c = self.cfg
        run.kv_wait = c.transfer_ms / 1000
        x = self.vm.nixl
        if x:
            blocks = (n_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
            x["xfer_time"].observe(c.transfer_ms / 1000)
            x["post_time"].observe(0.0)
            x["bytes"].observe(n_tokens * KV_BYTES_PER_TOKEN // max(1, c.tp))
            x["descriptors"].observe(blocks * NUM_LAYERS)

    async def _next_events(self, run: Run) -> list[Event]:
        """The next events of a request: all of them at once on a zero-delay engine (each
        round of its sequences standing for one engine step), else the next step's."""
        if run.kv_wait:
            wait, run.kv_wait = run.kv_wait, 0.0
            await asyncio.sleep(wait)
        if not run.scheduled and self.engine.zero_delay and self.state["fault"] != "stall":
            run.scheduled = run.direct = True
            events: list[Event] = []
            live = list(run.seqs)
            now = time.monotonic()
            for s in live:  # admitted in order: a later choice hits an earlier one's blocks
                s.mark_scheduled(now)
                s.schedule(s.prefill_left)
            step_tokens = sum(s.prefill_left for s in live)  # the first step prefills
            while live:
                now = time.monotonic()
                for s in live:
                    if s.n_out:
                        s.schedule(1)
                    events.append(s.emit(now))
                self.vm.iteration.observe(step_tokens + len(live))
                step_tokens = 0
                if any(s.done for s in live):
                    live = [s for s in live if not s.done]
            return events
        if not run.scheduled:
            run.scheduled = True
            self.engine.submit(list(run.seqs))
        if not run.seqs:
            return []
        return [await run.queue.get(), *_drain(run.queue)]

    async def _collect(self, run: Run) -> None:
        while not (run.done and run.queue.empty()):
            await self._next_events(run)

    async def _full(self, ctx: Ctx, run: Run) -> web.Response:
        await self._collect(run)
        req = ctx.req
        kv_out = None
        if ctx.nixl_prefill and run.seqs:
            kv_out = self._nixl_params(ctx, run.seqs[0])
        if ctx.lmcache_spec is not None and run.seqs:
            first = run.seqs[0].tokens[0]
            kv_out = {"first_tok": first}
            self._spawn(self._lmcache_send(ctx.lmcache_spec, req.prompts[0], first))
        return _json(self._full_response(ctx, run, kv_out))

    def _answer_model(self, req: P.Request) -> str:
        """The ``model`` an answer carries: the adapter's name for an adapter's request, else
        the first served name (vLLM 0.31.0 OpenAIServingModels.model_name)."""
        return req.model if req.model in self.cfg.lora_modules else self.cfg.model

    def _full_response(self, ctx: Ctx, run: Run, kv_out: dict[str, Any] | None) -> dict[str, Any]:
        """completion/serving.py request_output_to_completion_response and
        chat_completion/serving.py chat_completion_full_generator (0.31), as model_dump()
        writes CompletionResponse / ChatCompletionResponse."""
        req = ctx.req
        v33 = self.cfg.vllm_version == "0.33"
        choices = []
        for s in run.seqs:
            choice: dict[str, Any] = {"index": s.index}
            if req.chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": s.text.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                }
            else:
                choice["text"] = s.text.text
            ids = req.return_token_ids  # output ids per choice; prompt ids per choice or once
            pairs = list(zip(s.tokens, s.states, strict=True))
            choice.update(
                logprobs=_logprobs(req, pairs, 0)[0],
                finish_reason=s.finish,
                stop_reason=s.stop_reason,
                token_ids=list(s.tokens) if ids else None,
            )
            if not req.chat:
                prompt_ids = req.prompts[s.prompt_index] if ids else None
                choice.update(prompt_logprobs=None, prompt_token_ids=prompt_ids)
            choice["routed_experts"] = None
            if v33:
                choice["weight_versions"] = None
            choices.append(choice)
        # chat counts its one prompt once; completions each prompt once (not per choice)
        n_prompt = sum(len(p) for p in req.prompts)
        n_gen = sum(s.n_out for s in run.seqs)
        usage = {
            "prompt_tokens": n_prompt,
            "total_tokens": n_prompt + n_gen,
            "completion_tokens": n_gen,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        out: dict[str, Any] = {
            "id": ctx.rid,
            "object": "chat.completion" if req.chat else "text_completion",
            "created": ctx.created,
            "model": self._answer_model(req),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": ctx.fingerprint,
            "usage": usage,
        }
        if req.chat:
            prompt_ids = req.prompts[0] if req.return_token_ids else None
            out.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, prompt_text=None)
        out.update(kv_transfer_params=kv_out, ec_transfer_params=None, metrics=None)
        return out

    async def _stream(self, request: web.Request, ctx: Ctx, run: Run) -> web.StreamResponse:
        """completion/serving.py completion_stream_generator and chat_completion/serving.py
        chat_completion_stream_generator (0.31): one chunk per choice per engine output, as
        ``model_dump_json(exclude_unset=True)`` writes them; the chat role chunks of all
        choices come with the first output; a last usage chunk with
        ``stream_options.include_usage``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)  # headers go out at once, like vLLM
        if self._fault() == "hang_after_headers":
            self._consume_fault()
            await self._hang()
        req = ctx.req
        chat = req.chat
        head = {
            "id": ctx.rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": ctx.created,
            "model": self._answer_model(req),
        }
        n_prompt = [len(p) for p in req.prompts]
        n_tok = [0] * len(run.seqs)
        offset = [0] * len(run.seqs)  # each choice's text so far (completions' text_offset)
        seq_prompt = [s.prompt_index for s in run.seqs]
        first = True
        while run.seqs:
            events = await self._next_events(run)
            buf: list[bytes] = []
            if first and chat:
                for i in range(len(run.seqs)):
                    role: dict[str, Any] = {
                        **head,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    if req.continuous_usage:
                        role["usage"] = {
                            **_usage(n_prompt[0], 0),
                            "completion_tokens_details": None,
                        }
                    # the prompt's ids at the first chunk ever (chat_completion/serving.py)
                    ids = req.prompts[0] if req.return_token_ids and i == 0 else None
                    role.update(prompt_token_ids=ids, prompt_text=None)
                    buf.append(_sse(role))
            first = False
            for ev in events:
                n_tok[ev.index] += 1
                logprobs, _ = _logprobs(req, [(ev.token, ev.state)], offset[ev.index])
                # completion/serving.py: a chunk's offset is the length of the text sent before
                # it (a stop string's hold-back included), not of the tokens before it
                offset[ev.index] += len(ev.text)
                if chat:
                    choice: dict[str, Any] = {
                        "index": ev.index,
                        "delta": {"content": ev.text},
                        "logprobs": logprobs,
                        "finish_reason": ev.finish,
                    }
                    if ev.finish is not None:
                        choice["stop_reason"] = ev.stop_reason
                    choice["token_ids"] = [ev.token] if req.return_token_ids else None
                else:
                    # completion/serving.py: a choice's first chunk carries the prompt's ids
                    prompt_ids = None
                    if req.return_token_ids and n_tok[ev.index] == 1:
                        prompt_ids = req.prompts[seq_prompt[ev.index]]
                    choice = {
                        "index": ev.index,
                        "text": ev.text,
                        "logprobs": logprobs,
                        "finish_reason": ev.finish,
                        "stop_reason": ev.stop_reason,
                        "prompt_token_ids": prompt_ids,
                        "token_ids": [ev.token] if req.return_token_ids else None,
                    }
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if ev.finish is not None and not req.include_usage:
                    chunk["system_fingerprint"] = ctx.fingerprint
                if req.continuous_usage:
                    # chat sets completion_tokens_details explicitly (to None), completions not
                    usage = _usage(n_prompt[seq_prompt[ev.index]], n_tok[ev.index])
                    if chat:
                        usage["completion_tokens_details"] = None
                    chunk["usage"] = usage
                buf.append(_sse(chunk))
            await resp.write(b"".join(buf))
            if self.state["fault"] == "stall":
                # hold the stream after the first tokens until POST /sim/release
                await self.release.wait()
            if run.done and run.queue.empty():
                break
        tail = b""
        if req.include_usage:
            total_prompt = n_prompt[0] if chat else sum(n_prompt)
            usage_chunk = {
                **head,
                "choices": [],
                "usage": _usage(total_prompt, sum(n_tok)),
                "system_fingerprint": ctx.fingerprint,
            }
            tail = _sse(usage_chunk)
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _kv_load_failed(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        """A decode whose NIXL KV load fails under ``kv_load_failure_policy: fail``, as vLLM
        0.31.0 answers it (seen on its CPU build with an unreachable side channel): the request
        finishes with reason ``error`` and no token; a whole answer is a 500, a stream is a 200
        with a chat's role chunk, the usage chunk when asked, and ``[DONE]``."""
        self.vm.success["error"].inc()
        if "failed_transfers" in self.vm.nixl:
            self.vm.nixl["failed_transfers"].inc()
        req = ctx.req
        if not req.stream:
            return _err(500, "Internal server error", "InternalServerError")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        head = {
            "id": ctx.rid,
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": ctx.created,
            "model": self._answer_model(req),
        }
        out = b""
        if req.chat:
            delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            out += _sse(
                {**head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None}
            )
        if req.include_usage:
            usage = {"choices": [], "usage": _usage(len(req.prompts[0]), 0)}
            out += _sse({**head, **usage, "system_fingerprint": ctx.fingerprint})
        await resp.write(out + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _stream_error(self, request: web.Request, err: P.ApiError) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(_sse(err.body()) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.bg.add(t)
        t.add_done_callback(self.bg.discard)

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
        if self.kv_events is not None:
            self.kv_events.close()


def build_app(cfg: SimConfig) -> tuple[web.Application, SimEngine]:
    sim = SimEngine(cfg)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", sim.health)
    app.router.add_get("/v1/models", sim.models)
    app.router.add_post("/tokenize", sim.tokenize)
    app.router.add_post("/detokenize", sim.detokenize)
    app.router.add_post("/v1/completions", sim.completions)
    app.router.add_post("/v1/chat/completions", sim.chat)
    app.router.add_get("/metrics", sim.metrics)
    app.router.add_get("/kv_event_sources", sim.kv_event_sources)
    app.router.add_post("/sim/fault", sim.sim_fault)
    app.router.add_get("/sim/requests", sim.sim_requests)
    app.router.add_get("/sim/prefix_cache", sim.sim_prefix_cache)
    app.router.add_post("/sim/release", sim.sim_release)
    app.router.add_route("*", "/{tail:.*}", sim.not_found)  # last: vLLM's 404 / 405

    async def on_startup(_: web.Application) -> None:
        await sim.start_receiver()
        if sim.kv_events is not None:
            sim.kv_events.start()

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


def _adapter_seed(model: str | None, adapters: tuple[str, ...]) -> int:
    """Another "weights" for an adapter's requests: its answers differ from the base model's
    and from every other adapter's, the same on every engine that serves it."""
    if model is None or model not in adapters:
        return 0
    return zlib.crc32(model.encode()) | 1
