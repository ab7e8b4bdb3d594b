"""LMCache PD hand-off (LMCacheConnectorV1, ``enable_pd``), proxy side, as named steps:
plan -> prefill -> first token -> await KV -> decode -> reshape.

Checked against LMCache 0.5.6 (``examples/disagg_prefill/disagg_proxy_server.py`` and
``lmcache/v1/storage_backend/pd_backend.py``) and pd-protocols.md section 1:

1. the decoder is chosen first; its host and per-TP-rank receiver ports go into
   ``kv_transfer_params.disagg_spec`` of a NON-streaming prefill request with ``max_tokens``
   1 and ``ret_first_tok`` present. LMCache's proxy tokenizes first and sends the ids to
   ``/v1/completions``; this router does so only when the decision already learnt the ids or
   the context length is still unknown (the first request's /tokenize learns it). Otherwise
   the prefill leg is the client's own request (its path, ``messages`` or ``prompt``) with
   ``return_token_ids`` (vLLM 0.31.0 and 0.33.0, ``CompletionResponseChoice.prompt_token_ids``
   / ``ChatCompletionResponse.prompt_token_ids``): one upstream call fewer (issue 15), and the
   decoder gets exactly the ids the prefiller computed the KV of;
2. the prefill response carries ``kv_transfer_params.first_tok``;
3. every prefill TP rank PUSHes one ``ProxyNotif(req_id)`` once its chunks landed
   (:mod:`.lmcache_notify` waits for them);
4. then the decoder gets ``prompt = ids + [first_tok]``, ``max_tokens - 1``, no
   ``kv_transfer_params``; its ``text_completion`` answer is reshaped into what the client
   asked for (chat or completions, whole or streamed), in the shape vLLM gives the same
   request directly (``lmcache_answer``: every field the leg carries, the chat stream's
   role-only first chunk, ``stop_reason``, usage details), under a fresh id of vLLM's format.

A missing notification times out and the request is decoded anyway (``fallback``, counted) on
a decoder other than the one that may hold a partial KV.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from pd_router import revision
from pd_router.config import LMCache, RouterConfig
from pd_router.discovery import Endpoint
from pd_router.failures import UPSTREAM_ERRORS, LegError, TokenizeError
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.lmcache_answer import (
    SseEvents,
    adjust_usage,
    new_completion_id,
    relabel_chunk,
    role_chunk,
    stream_usage,
    token_chunk,
    usage_chunk,
    whole_answer,
)
from pd_router.handoff.lmcache_notify import KvWaiter, Ticket, build_waiter
from pd_router.http1 import Answer
from pd_router.lease import Lease
from pd_router.legs import JSON, SSE_HEADERS, ClientGone, Downstream, Legs
from pd_router.lengths import effective_max_tokens, lower_min_tokens, min_tokens_above
from pd_router.request import DISAGG, Ctx, Fallback
from pd_router.tracing import Trace
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
# Request fields of vLLM 0.31.0 (openai/{completion,chat_completion}/protocol.py) whose
# answer a split request cannot equal, when set (not null/false): token ids of the prompt and
# the output (the decode leg's prompt holds the first token), the rendered prompt text, beam
# search (over the whole output), a prompt truncated from the left (the decode leg's prompt is
# one token longer), and what counts or looks back over the output (a thinking budget,
# repetition detection).
SHAPE_UNSUPPORTED = (
    "return_token_ids",
    "return_prompt_text",
    "use_beam_search",
    "truncate_prompt_tokens",
    "thinking_token_budget",
    "repetition_detection",
)
COMPLETIONS_UNSUPPORTED = ("echo", "logprobs", *SPLIT_UNSUPPORTED, *SHAPE_UNSUPPORTED)


def _set(v: Any) -> bool:
    return v is not None and v is not False


def chat_supported(body: dict[str, Any]) -> bool:
    return (
        not any(body.get(k) for k in CHAT_ONLY_UNSUPPORTED)
        and not any(body.get(k) is not None for k in SPLIT_UNSUPPORTED)
        and not any(_set(body.get(k)) for k in SHAPE_UNSUPPORTED)
    )


def completions_supported(body: dict[str, Any]) -> bool:
    return not any(_set(body.get(k)) for k in COMPLETIONS_UNSUPPORTED)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in _DROP_FOR_COMPLETIONS}


# What the client's own request loses to become its prefill leg (ids learnt from the answer).
_DROP_FOR_PREFILL = {
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "kv_transfer_params",
    "n",
}


def prefill_body(
    body: dict[str, Any],
    ids: list[int] | None,
    req_id: str,
    receiver_host: str,
    init_ports: list[int],
    alloc_ports: list[int],
) -> dict[str, Any]:
    """``ids`` None: the client's prompt as it sent it, asking the engine for its ids."""
    if ids is None:
        req = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
        req["return_token_ids"] = True
    else:
        req = _sampling(body)
        req["prompt"] = ids
    lower_min_tokens(req, produced=0, limit=1)
    req.update(
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
    """What the hand-off will use: both engines, the prompt ids and the total output length
    (both None until the prefill leg's answer gives the ids), the prompt tokens the
    prefiller's load counts meanwhile."""

    pre: Endpoint
    dec: Endpoint
    ids: list[int] | None
    max_tokens: int | None
    ntok: int


@dataclass(slots=True)
class First:
    """The prefill leg's answer: the first output token (id and text), why it stopped, and
    the whole ``text_completion`` answer (the template when that token is the answer)."""

    tok: int
    text: str
    finish: Any
    stop_reason: Any
    leg: dict[str, Any]
    ids: list[int]  # the prompt's ids: the plan's, or the prefiller's ``prompt_token_ids``


def build_route(cfg: RouterConfig, legs: Legs, direct: DirectRoute) -> LMCacheRoute:
    """The hand-off of ``routing.connector: lmcache`` (pd_router.connectors), with its
    notification waiter and the counters of the receiver in use."""
    legs.outcomes.metrics.preset_lmcache(cfg.lmcache.notification_receiver)
    waiter = build_waiter(cfg.lmcache, legs.up, legs.outcomes.metrics)
    return LMCacheRoute(cfg.lmcache, legs, direct, waiter, bool(cfg.model.reasoning_parser))


class LMCacheRoute:
    def __init__(
        self, lm: LMCache, legs: Legs, direct: DirectRoute, waiter: KvWaiter, reasoning: bool
    ) -> None:
        self.lm = lm
        self.legs = legs
        self.direct = direct
        self.waiter = waiter
        # model.reasoningParser is set: the engines split a chat answer into ``reasoning`` and
        # ``content``, which a /v1/completions decode leg cannot do
        self.reasoning = reasoning

    async def start(self) -> None:
        await self.waiter.start()  # a notification port already taken stops start-up here

    async def stop(self) -> None:
        await self.waiter.stop()

    async def serve(self, ctx: Ctx, down: Downstream) -> Answer:
        """The hand-off; raises :class:`Fallback` (or LegError) while nothing has reached the
        client, the decoder and the notification waiter given up whatever happened."""
        plan = await self._plan(ctx)
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

    async def _plan(self, ctx: Ctx) -> Plan:
        """Both engines and the lengths; raises :class:`Fallback` with why the request cannot
        be split, or LegError when no decoder can serve it at all."""
        legs, body = self.legs, ctx.body
        supported = chat_supported(body) if ctx.chat else completions_supported(body)
        if not supported:
            raise Fallback("unsupported_fields")
        if ctx.chat and self.reasoning:
            raise Fallback("reasoning_parser")
        dec, pre = legs.pair(ctx)  # the prefiller by load and revision (none preferred here)
        ids = ctx.ids
        if ids is None and legs.model.max_model_len is not None:
            # the prefill leg's answer gives the ids; the lengths are checked then
            return Plan(pre, dec, None, None, ctx.ptok)
        if ids is None:
            try:
                ids = await legs.tokenize(ctx, pre, body, ctx.chat)
            except TokenizeError:
                legs.outcomes.upstream("prefill", "tokenize")
                raise Fallback("tokenize_error") from None
        return Plan(pre, dec, ids, self._lengths(ctx, len(ids)), len(ids))

    def _lengths(self, ctx: Ctx, n_prompt: int) -> int:
        """The split request's total output length; raises :class:`Fallback` with why it is
        served unsplit."""
        body, mml = ctx.body, self.legs.model.max_model_len
        mt = effective_max_tokens(body, ctx.chat, n_prompt, mml)
        if mt is None:
            raise Fallback("unknown_max_tokens")
        if min_tokens_above(body, mt):
            # invalid as sent: a decoder answers it exactly as vLLM does (400), unsplit
            raise Fallback("unsupported_fields")
        if mml is not None and n_prompt + mt > mml:
            # vLLM 0.31 refuses prompt + max_tokens above the context (400) but would accept the
            # 1-token prefill leg: unsplit, the client gets the decoder's own answer, never a 200
            # and one token before the error (0.33 clamps max_tokens and serves it). Learnt from
            # the prefill leg's answer, this costs that leg (its KV is never decoded).
            raise Fallback("too_long")
        return mt

    async def _run(
        self, ctx: Ctx, down: Downstream, plan: Plan, hold: Lease, ticket: Ticket
    ) -> Answer:
        legs = self.legs
        t0 = time.perf_counter()
        first = await self._prefill(ctx, plan, ticket.req_id)
        if plan.ids is None:  # learnt from the prefill leg
            plan.max_tokens = self._lengths(ctx, len(first.ids))
            plan.ids = first.ids
        assert plan.max_tokens is not None
        # the prefiller's success is reported once its hand-off completed (below): reported
        # here, it would reset the failures a missing notification counts every time
        done_after_first = first.finish == "stop" or plan.max_tokens == 1
        # a fresh id, never the client's X-Request-Id (vLLM's own would be; lmcache_answer)
        sid = new_completion_id(ctx.chat)
        created = int(time.time())
        if ctx.stream:
            try:
                await down.open_stream({**ctx.reply_headers(), **SSE_HEADERS})
                await down.write(
                    self._first_events(ctx, sid, created, first, done_after_first, len(first.ids))
                )
            except ClientGone:
                assert down.response is not None
                return down.response
            legs.outcomes.first_token(ctx)
        if done_after_first:
            legs.engine_ok(legs.prefill_pool, plan.pre)
            self.waiter.cancel(ticket)
            return await self._first_only(ctx, down, sid, created, first, len(first.ids))
        landed = await self._await_kv(ctx, plan, ticket, t0)
        body = decode_body(ctx.body, first.ids, first.tok, plan.max_tokens, ctx.stream)
        if landed:  # its revision's name: a decoder restarted on other bits refuses it
            body = revision.leg_model(body, legs.served, plan.dec.revision)
        data = orjson.dumps(body)
        hold.release()  # the decode leg counts itself from here on
        return await self._decode(ctx, down, plan, landed, data, sid, created, first.text)

    def _first_events(
        self, ctx: Ctx, sid: str, created: int, first: First, done: bool, n_prompt: int
    ) -> bytes:
        """The stream's opening: the chat role chunk, then the first token's chunk (its last
        when ``done``), as vLLM streams them; continuous usage stats count the prompt."""
        chat, model = ctx.chat, self.legs.served
        include, continuous = _usage_options(ctx.body)
        out = []
        if chat:
            usage = stream_usage(n_prompt, 0, True) if continuous else None
            out.append(role_chunk(sid, created, model, usage))
        finish = (first.finish or "length") if done else None
        fp = first.leg.get("system_fingerprint") if done and not include else None
        out.append(
            token_chunk(
                chat,
                sid,
                created,
                model,
                first.text,
                finish,
                first.stop_reason if done else None,
                stream_usage(n_prompt, 1, chat) if continuous else None,
                fp,
            )
        )
        return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in out)

    async def _prefill(self, ctx: Ctx, plan: Plan, req_id: str) -> First:
        """The prefill leg: its first token; raises :class:`Fallback` (Legs.prefill)."""
        legs, lm = self.legs, self.lm
        body = prefill_body(
            ctx.body, plan.ids, req_id, plan.dec.host, lm.decoder_init_ports, lm.decoder_alloc_ports
        )
        body = revision.leg_model(body, legs.served, plan.pre.revision)
        # ids known: a completion of them; else the client's own endpoint, asking for them
        path = DECODE_PATH if plan.ids is not None or not ctx.chat else ctx.path
        # its success is reported once the KV landed (_await_kv), not on this answer: reported
        # here, it would reset the failures a missing notification counts every time
        presp = await legs.prefill(ctx, plan.pre, path, body, plan.ntok)
        ids = plan.ids
        try:
            tok = presp["kv_transfer_params"]["first_tok"]
            ch = presp["choices"][0]
            if path == DECODE_PATH:
                text = ch.get("text") or ""
            else:
                text = ch["message"].get("content") or ""
            if ids is None:
                ids = presp["prompt_token_ids"] if ctx.chat else ch["prompt_token_ids"]
            finish = ch.get("finish_reason")
            stop_reason = ch.get("stop_reason")
        except (KeyError, TypeError, IndexError, AttributeError):
            tok = None
        if type(tok) is not int or type(ids) is not list or not ids:
            raise legs.prefill_broken(plan.pre, LegError("bad_response", 502))
        return First(tok, text, finish, stop_reason, presp, ids)

    async def _await_kv(self, ctx: Ctx, plan: Plan, ticket: Ticket, t0: float) -> bool:
        """Wait until the KV landed on the planned decoder; a broken hand-off counts against
        the prefiller like a failed prefill (ejected after passiveFailureThreshold in a row)."""
        legs = self.legs
        span = None
        if ctx.trace is not None:  # until every prefill rank's notification arrived
            expected = {"pd.lmcache.notifications": self.lm.notifications_per_request}
            span = ctx.trace.span("kv_handoff_wait", attrs=expected)
        outcome = await self.waiter.wait(ticket, plan.pre)
        if span is not None:
            span.attrs["pd.kv_handoff.outcome"] = outcome
            Trace.end(span, "" if outcome == "ok" else f"notify_{outcome}")
        legs.outcomes.handoff_wait("lmcache", time.perf_counter() - t0)
        if outcome == "ok":
            legs.engine_ok(legs.prefill_pool, plan.pre)
            return True
        legs.outcomes.upstream(
            "prefill", "sidecar_error" if outcome == "error" else "notify_timeout"
        )
        legs.engine_failed(legs.prefill_pool, plan.pre)
        legs.outcomes.fallback(ctx, "notify_timeout")
        log.warning("LMCache notification timed out", extra={"request_id": ctx.rid})
        return False

    async def _decode(
        self,
        ctx: Ctx,
        down: Downstream,
        plan: Plan,
        landed: bool,
        data: bytes,
        sid: str,
        created: int,
        first_text: str,
    ) -> Answer:
        """The decode leg: on the decoder holding the KV if it landed, else elsewhere if
        possible (its buffer may hold a partial KV)."""
        legs = self.legs
        try:
            if landed:
                resp, dep = await legs.open_decoder(
                    ctx,
                    DECODE_PATH,
                    data,
                    ctx.stream,
                    prefer=plan.dec,
                    named=bool(plan.dec.revision),
                )
            else:
                resp, dep = await legs.open_decoder(
                    ctx, DECODE_PATH, data, ctx.stream, exclude=(plan.dec,)
                )
        except LegError as err:
            if not down.streaming:
                return legs.fail(ctx, down, err)
            await down.stream_error("no decoder could continue the stream")
            assert down.response is not None
            return down.response
        if resp.status != 200 and down.streaming:
            etype, emsg = await legs.error_detail(resp)
            msg = f"decoder answered {resp.status}" + (f": {emsg}" if emsg else "")
            await down.stream_error(msg, etype or "upstream_error", resp.status)
            assert down.response is not None
            return down.response
        if not down.streaming:
            return await self._whole(ctx, down, resp, sid, created, first_text)
        return await self._stream(ctx, down, resp, dep, sid, created)

    # ------------------------------------------------------------------ reshape
    async def _first_only(
        self, ctx: Ctx, down: Downstream, sid: str, created: int, first: First, n_prompt: int
    ) -> Answer:
        """The answer was the prefiller's one token (it stopped, or one was asked for): the
        prefill leg's answer is the template (its usage counts the prompt and that token)."""
        usage = first.leg.get("usage")
        if not isinstance(usage, dict):
            usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + 1}
            usage["completion_tokens"] = 1
        if down.streaming:
            tail = b"data: [DONE]\n\n"
            if _usage_options(ctx.body)[0]:  # as vLLM: a last usage chunk
                last = usage_chunk(
                    ctx.chat,
                    sid,
                    created,
                    self.legs.served,
                    usage,
                    first.leg.get("system_fingerprint"),
                )
                tail = b"data: " + orjson.dumps(last) + b"\n\n" + tail
            assert down.response is not None
            with contextlib.suppress(ClientGone):  # the Downstream records which
                await down.write(tail)
                await down.end()
            return down.response
        leg = {**first.leg, "created": created}
        if not leg["choices"][0].get("finish_reason"):
            leg["choices"] = [{**leg["choices"][0], "finish_reason": "length"}]
        whole = whole_answer(ctx.chat, sid, self.legs.served, leg, first.text, usage)
        return down.reply(200, orjson.dumps(whole), ctx.reply_headers(), JSON)

    async def _whole(
        self, ctx: Ctx, down: Downstream, resp: Response, sid: str, created: int, first_text: str
    ) -> Answer:
        """A non-streamed decode answer, with the first token put back in front."""
        legs, out = self.legs, self.legs.outcomes
        try:
            raw = await resp.read_release()  # closed on failure or client disconnect
        except UPSTREAM_ERRORS:
            out.upstream("decode", "stream")
            return legs.fail(ctx, down, LegError("stream", 502))
        if resp.status != 200:
            return down.reply(resp.status, raw, ctx.reply_headers(), JSON)
        try:
            d = orjson.loads(raw)
            text = first_text + (d["choices"][0].get("text") or "")
            usage = adjust_usage(d.get("usage"))
            # one ``created`` for the request, as vLLM stamps it when the request arrives
            whole = whole_answer(ctx.chat, sid, legs.served, {**d, "created": created}, text, usage)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            out.upstream("decode", "bad_response")
            return legs.fail(ctx, down, LegError("bad_response", 502))
        return down.reply(200, orjson.dumps(whole), ctx.reply_headers(), JSON)

    async def _stream(
        self, ctx: Ctx, down: Downstream, resp: Response, dep: Endpoint, sid: str, created: int
    ) -> Answer:
        """Relay the decode leg's SSE events, re-labelled with our id (and as chat chunks)."""
        events = SseEvents()
        chat, model = ctx.chat, self.legs.served

        def relabel(chunk: bytes) -> bytes:
            return b"".join(_relabel(events.feed(chunk), chat, sid, created, model))

        return await self.legs.pump(ctx, down, resp, dep, relabel)


def _usage_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM reads ``stream_options``
    (serve/utils/api_utils.py should_include_usage, 0.31.0; the engine flag
    ``--enable-force-include-usage``, which turns both on, is not known to the router)."""
    so = body.get("stream_options")
    if not isinstance(so, dict):
        return False, False
    include = bool(so.get("include_usage"))
    return include, include and bool(so.get("continuous_usage_stats"))


def _relabel(events: list[bytes], chat: bool, sid: str, created: int, model: str) -> list[bytes]:
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
            if isinstance(d, dict):
                d = relabel_chunk(d, chat, sid, created, model)
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            continue
        outb.append(b"data: " + orjson.dumps(d) + b"\n\n")
    return outb
