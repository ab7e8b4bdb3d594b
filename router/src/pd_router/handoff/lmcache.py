"""LMCache PD hand-off (LMCacheConnectorV1, ``enable_pd``), proxy side, as named steps:
plan -> prefill -> first token -> await KV -> decode -> reshape.

Checked against LMCache 0.5.6 (``examples/disagg_prefill/disagg_proxy_server.py`` and
``lmcache/v1/storage_backend/pd_backend.py``) and pd-protocols.md section 1:

1. the decoder is chosen first; its host and per-TP-rank receiver ports go into
   ``kv_transfer_params.disagg_spec`` of a NON-streaming ``/v1/completions`` prefill request
   whose ``prompt`` is the token ids and ``max_tokens`` is 1, with ``ret_first_tok`` present;
2. the prefill response carries ``kv_transfer_params.first_tok``;
3. every prefill TP rank PUSHes one ``ProxyNotif(req_id)`` once its chunks landed
   (:mod:`.lmcache_notify` waits for them);
4. then the decoder gets ``prompt = ids + [first_tok]``, ``max_tokens - 1``, no
   ``kv_transfer_params``; its ``text_completion`` answer is reshaped into what the client
   asked for (chat or completions, whole or streamed) under the router's id.

A missing notification times out and the request is decoded anyway (``fallback``, counted) on
a decoder other than the one that may hold a partial KV.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from pd_router import balancing
from pd_router.config import LMCache
from pd_router.discovery import Endpoint
from pd_router.failures import UPSTREAM_ERRORS, LegError, TokenizeError
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.lmcache_notify import KvWaiter, Ticket
from pd_router.lease import Lease
from pd_router.legs import JSON, SSE_HEADERS, ClientGone, Downstream, Legs
from pd_router.lengths import effective_max_tokens, lower_min_tokens, min_tokens_above
from pd_router.openai_wire import SseEvents, adjust_usage, answer, completion_to_chat_chunk
from pd_router.request import DISAGG, FALLBACK, Ctx
from pd_router.upstream import Response

log = logging.getLogger("pd_router.lmcache")

DECODE_PATH = "/v1/completions"  # both legs are completions of token ids

# Chat features whose output cannot be rebuilt from a /v1/completions decode leg: such
# requests are served directly by a decoder instead.
CHAT_ONLY_UNSUPPORTED = (
    "tools",
    "functions",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "parallel_tool_calls",
    "continue_final_message",
    "echo",
)
_DROP_FOR_COMPLETIONS = {
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "kv_transfer_params",
    "add_generation_prompt",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "n",
    "user",
    "modalities",
    "audio",
    "prediction",
    "store",
    "metadata",
    "reasoning_effort",
    "web_search_options",
}
# Features of either endpoint whose state lives across tokens (a grammar, prompt logprobs of
# the client's prompt): the decode leg would restart them after the first token.
SPLIT_UNSUPPORTED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "response_format",
    "prompt_logprobs",
)
COMPLETIONS_UNSUPPORTED = ("echo", "logprobs", *SPLIT_UNSUPPORTED)


def chat_supported(body: dict[str, Any]) -> bool:
    return not any(body.get(k) for k in CHAT_ONLY_UNSUPPORTED) and not any(
        body.get(k) is not None for k in SPLIT_UNSUPPORTED
    )


def completions_supported(body: dict[str, Any]) -> bool:
    return not any(
        body.get(k) is not None and body.get(k) is not False for k in COMPLETIONS_UNSUPPORTED
    )


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in _DROP_FOR_COMPLETIONS}


def prefill_body(
    body: dict[str, Any],
    ids: list[int],
    req_id: str,
    receiver_host: str,
    init_ports: list[int],
    alloc_ports: list[int],
) -> dict[str, Any]:
    req = _sampling(body)
    lower_min_tokens(req, produced=0, limit=1)
    req.update(
        prompt=ids,
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "ret_first_tok": True,
            "disagg_spec": {
                "req_id": req_id,
                "receiver_host": receiver_host,
                "receiver_init_port": list(init_ports),
                "receiver_alloc_port": list(alloc_ports),
            },
        },
    )
    return req


def decode_body(
    body: dict[str, Any], ids: list[int], first_tok: int, max_tokens: int, stream: bool
) -> dict[str, Any]:
    """``max_tokens``: the effective total (``lengths.effective_max_tokens``); the first token
    came from the prefiller, so the decoder makes one fewer, and needs one fewer minimum."""
    req = _sampling(body)
    req["prompt"] = [*ids, first_tok]
    req["stream"] = stream
    req["max_tokens"] = max_tokens - 1
    lower_min_tokens(req, produced=1)
    so = body.get("stream_options")
    if stream and so is not None:
        req["stream_options"] = so
    return req


@dataclass(slots=True)
class Plan:
    """What the hand-off will use: both engines, the prompt ids, the total output length."""

    pre: Endpoint
    dec: Endpoint
    ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class First:
    """The prefill leg's answer: the first output token (id and text) and why it stopped."""

    tok: int
    text: str
    finish: Any


NO_DECODER = "no_decoder"  # a plan outcome, not a fallback: nobody can serve it


class LMCacheRoute:
    def __init__(self, lm: LMCache, legs: Legs, direct: DirectRoute, waiter: KvWaiter) -> None:
        self.lm = lm
        self.legs = legs
        self.direct = direct
        self.waiter = waiter

    async def serve(self, ctx: Ctx, down: Downstream) -> web.StreamResponse:
        plan = await self._plan(ctx)
        if plan == NO_DECODER:
            return self.legs.fail(ctx, down, LegError.no_decoder())
        if isinstance(plan, str):
            return await self.direct.fallback(ctx, down, plan)
        ctx.route = DISAGG
        req_id = f"{ctx.rid}-{uuid.uuid4().hex[:8]}"
        # Held while its KV arrives, so concurrent long prompts spread over decoders.
        hold = Lease(plan.dec)
        ticket = self.waiter.expect(req_id)
        try:
            return await self._run(ctx, down, plan, hold, ticket)
        finally:  # whatever happened: the decoder and the notification waiter are given up
            hold.release()
            self.waiter.cancel(ticket)

    async def _plan(self, ctx: Ctx) -> Plan | str:
        """Both engines and the lengths, or why the request cannot be split (a fallback
        reason, or NO_DECODER)."""
        legs, body = self.legs, ctx.body
        supported = chat_supported(body) if ctx.chat else completions_supported(body)
        if not supported:
            return "unsupported_fields"
        pre = balancing.pick(legs.prefill_pool.healthy, balancing.prefill_load)
        if pre is None:
            return "no_prefiller"
        dec = balancing.pick(legs.decode_pool.healthy, balancing.decode_load, ctx.affinity)
        if dec is None:
            return NO_DECODER
        ids = ctx.ids
        if ids is None:
            try:
                ids = await legs.tokenize(ctx, pre, body, ctx.chat)
            except TokenizeError:
                legs.outcomes.upstream("prefill", "tokenize")
                return "tokenize_error"
        mml = legs.max_model_len
        mt = effective_max_tokens(body, ctx.chat, len(ids), mml)
        if mt is None:
            return "unknown_max_tokens"
        if min_tokens_above(body, mt):
            # invalid as sent: a decoder answers it exactly as vLLM does (400), unsplit
            return "unsupported_fields"
        if mml is not None and len(ids) + mt > mml:
            # vLLM 0.31 refuses prompt + max_tokens above the context (400) but would accept the
            # 1-token prefill leg: unsplit, the client gets the decoder's own answer, never a 200
            # and one token before the error (0.33 clamps max_tokens and serves it)
            return "too_long"
        return Plan(pre, dec, ids, mt)

    async def _run(
        self, ctx: Ctx, down: Downstream, plan: Plan, hold: Lease, ticket: Ticket
    ) -> web.StreamResponse:
        legs = self.legs
        t0 = time.perf_counter()
        first = await self._prefill(ctx, plan, ticket.req_id)
        if isinstance(first, tuple):  # an engine 4xx, as it sent it
            return legs.passthrough(ctx, down, *first)
        if isinstance(first, str):
            hold.release()  # not waiting for a KV any more
            self.waiter.cancel(ticket)
            return await self.direct.fallback(ctx, down, first)
        # the prefiller's success is reported once its hand-off completed (below): reported
        # here, it would reset the failures a missing notification counts every time
        done_after_first = first.finish == "stop" or plan.max_tokens == 1
        sid = ("chatcmpl-" if ctx.chat else "cmpl-") + ctx.rid
        created = int(time.time())
        if ctx.stream:
            chunk = answer(
                ctx.chat,
                sid,
                created,
                legs.served,
                first.text,
                (first.finish or "length") if done_after_first else None,
            )
            try:
                await down.open_stream({**ctx.reply_headers(), **SSE_HEADERS})
                await down.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            except ClientGone:
                legs.outcomes.disconnect(ctx)
                assert down.response is not None
                return down.response
            legs.outcomes.first_token(ctx)
        if done_after_first:
            legs.prefill_pool.report_success(plan.pre)
            self.waiter.cancel(ticket)
            return await self._first_only(ctx, down, sid, created, first, len(plan.ids))
        landed = await self._await_kv(ctx, plan, ticket, t0)
        data = orjson.dumps(decode_body(ctx.body, plan.ids, first.tok, plan.max_tokens, ctx.stream))
        hold.release()  # the decode leg counts itself from here on
        return await self._decode(ctx, down, plan, landed, data, sid, first.text)

    async def _prefill(self, ctx: Ctx, plan: Plan, req_id: str) -> First | str | tuple[int, bytes]:
        """The prefill leg: its first token, a fallback reason, or an engine 4xx."""
        legs, lm = self.legs, self.lm
        body = prefill_body(
            ctx.body, plan.ids, req_id, plan.dec.host, lm.decoder_init_ports, lm.decoder_alloc_ports
        )
        try:
            status, presp, praw = await legs.prefill(
                ctx, plan.pre, DECODE_PATH, body, len(plan.ids)
            )
        except LegError as err:
            return legs.prefill_failed(plan.pre, err)
        if status != 200:
            return status, praw
        try:
            tok = presp["kv_transfer_params"]["first_tok"]
            ch = presp["choices"][0]
            text = ch.get("text") or ""
            finish = ch.get("finish_reason")
        except (KeyError, TypeError, IndexError, AttributeError):
            tok = None
        if type(tok) is not int:
            return legs.prefill_failed(plan.pre, LegError("bad_response", 502))
        return First(tok, text, finish)

    async def _await_kv(self, ctx: Ctx, plan: Plan, ticket: Ticket, t0: float) -> bool:
        """Wait until the KV landed on the planned decoder; a broken hand-off counts against
        the prefiller like a failed prefill (ejected after passiveFailureThreshold in a row)."""
        legs = self.legs
        outcome = await self.waiter.wait(ticket, plan.pre)
        legs.outcomes.handoff_wait("lmcache", time.perf_counter() - t0)
        if outcome == "ok":
            legs.prefill_pool.report_success(plan.pre)
            return True
        legs.outcomes.upstream(
            "prefill", "sidecar_error" if outcome == "error" else "notify_timeout"
        )
        legs.prefill_pool.report_failure(plan.pre)
        legs.outcomes.fallback("notify_timeout")
        log.warning("LMCache notification timed out", extra={"request_id": ctx.rid})
        ctx.route = FALLBACK
        return False

    async def _decode(
        self,
        ctx: Ctx,
        down: Downstream,
        plan: Plan,
        landed: bool,
        data: bytes,
        sid: str,
        first_text: str,
    ) -> web.StreamResponse:
        """The decode leg: on the decoder holding the KV if it landed, else elsewhere if
        possible (its buffer may hold a partial KV)."""
        legs = self.legs
        try:
            if landed:
                resp, dep = await legs.open_decoder(
                    ctx, DECODE_PATH, data, ctx.stream, prefer=plan.dec
                )
            else:
                resp, dep = await legs.open_decoder(
                    ctx, DECODE_PATH, data, ctx.stream, exclude=(plan.dec,)
                )
        except LegError as err:
            if not down.streaming:
                return legs.fail(ctx, down, err)
            await down.stream_error("no decoder could continue the stream")
            legs.outcomes.count(ctx.route, "upstream_error")
            assert down.response is not None
            return down.response
        if resp.status != 200 and down.streaming:
            etype, emsg = await legs.error_detail(resp)
            msg = f"decoder answered {resp.status}" + (f": {emsg}" if emsg else "")
            await down.stream_error(msg, etype or "upstream_error", resp.status)
            legs.outcomes.count(ctx.route, "upstream_error")
            assert down.response is not None
            return down.response
        if not down.streaming:
            return await self._whole(ctx, down, resp, sid, first_text)
        return await self._stream(ctx, down, resp, dep, sid)

    # ------------------------------------------------------------------ reshape
    async def _first_only(
        self, ctx: Ctx, down: Downstream, sid: str, created: int, first: First, n_prompt: int
    ) -> web.StreamResponse:
        """The answer was the prefiller's one token (it stopped, or one was asked for)."""
        out = self.legs.outcomes
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 1, "total_tokens": n_prompt + 1}
        if down.streaming:
            tail = b"data: [DONE]\n\n"
            so = ctx.body.get("stream_options")
            if isinstance(so, dict) and so.get("include_usage"):  # as vLLM: a last usage chunk
                obj = "chat.completion.chunk" if ctx.chat else "text_completion"
                last = {"id": sid, "object": obj, "created": created, "model": self.legs.served}
                last.update(choices=[], usage=usage)
                tail = b"data: " + orjson.dumps(last) + b"\n\n" + tail
            assert down.response is not None
            try:
                await down.write(tail)
                await down.end()
            except ClientGone:
                out.disconnect(ctx)
                return down.response
            out.finished(ctx)
            out.count(ctx.route, "ok")
            return down.response
        whole = answer(
            ctx.chat, sid, created, self.legs.served, first.text, first.finish or "length", usage
        )
        out.finished(ctx)
        out.count(ctx.route, "ok")
        return down.reply(200, orjson.dumps(whole), ctx.reply_headers(), JSON)

    async def _whole(
        self, ctx: Ctx, down: Downstream, resp: Response, sid: str, first_text: str
    ) -> web.StreamResponse:
        """A non-streamed decode answer, with the first token put back in front."""
        legs, out = self.legs, self.legs.outcomes
        try:
            raw = await resp.read_release()  # closed on failure or client disconnect
        except UPSTREAM_ERRORS:
            out.upstream("decode", "stream")
            return legs.fail(ctx, down, LegError("stream", 502))
        if resp.status != 200:
            out.count(ctx.route, "client_error")
            return down.reply(resp.status, raw, ctx.reply_headers(), JSON)
        try:
            d = orjson.loads(raw)
            ch = d["choices"][0]
            whole = answer(
                ctx.chat,
                sid,
                d.get("created", int(time.time())),
                legs.served,
                first_text + (ch.get("text") or ""),
                ch.get("finish_reason"),
                adjust_usage(d.get("usage")),
            )
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            out.upstream("decode", "bad_response")
            return legs.fail(ctx, down, LegError("bad_response", 502))
        out.answered(ctx)
        out.count(ctx.route, "ok")
        return down.reply(200, orjson.dumps(whole), ctx.reply_headers(), JSON)

    async def _stream(
        self, ctx: Ctx, down: Downstream, resp: Response, dep: Endpoint, sid: str
    ) -> web.StreamResponse:
        """Relay the decode leg's SSE events, re-labelled with our id (and as chat chunks)."""
        events = SseEvents()
        chat = ctx.chat

        def relabel(chunk: bytes) -> bytes:
            return b"".join(_relabel(events.feed(chunk), chat, sid))

        return await self.legs.pump(ctx, down, resp, dep, relabel)


def _relabel(events: list[bytes], chat: bool, sid: str) -> list[bytes]:
    """Decode-leg SSE events re-labelled with our id (and as chat chunks)."""
    outb = []
    for raw_ev in events:
        ev = raw_ev.strip()
        if not ev.startswith(b"data:"):
            continue
        payload = ev[5:].strip()
        if payload == b"[DONE]":
            outb.append(b"data: [DONE]\n\n")
            continue
        try:
            d = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if chat:
            d = completion_to_chat_chunk(d, sid)
        else:
            d["id"] = sid
            if d.get("usage") is not None:
                d["usage"] = adjust_usage(d["usage"])
        outb.append(b"data: " + orjson.dumps(d) + b"\n\n")
    return outb
