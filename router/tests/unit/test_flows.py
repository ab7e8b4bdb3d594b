"""Each route's flow over fake legs (a scripted upstream, a recording client): what each
engine is sent, what the client gets, what is counted, and that every endpoint lease is given
back whatever happened."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
import pytest
from fakes import AsApp, FakeDownstream, FakeResponse, FakeWaiter, Held, World, ctx

from pd_router import balancing
from pd_router.config import Health, LMCache
from pd_router.failures import LegError
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.lmcache import LMCacheRoute
from pd_router.handoff.nixl import PREFILL_PARAMS, NixlRoute
from pd_router.lease import Lease
from pd_router.legs import ClientGone, Downstream
from pd_router.request import Ctx

P1, D1, D2 = 9001, 9101, 9102
KVP = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def completion(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        **extra,
    }


# ---------------------------------------------------------------------- the lease
def test_a_lease_is_given_back_exactly_once() -> None:
    w = World()
    ep = w.ep(P1)
    lease = Lease(ep, 40)
    assert (ep.active, ep.queued_tokens) == (1, 40)
    lease.release()
    lease.release()
    assert (ep.active, ep.queued_tokens) == (0, 0)


# ---------------------------------------------------------------------- direct
def first_choice(w: World, key: str) -> tuple[int, int]:
    """(first, second) decoder port the balancer picks for affinity ``key``."""
    first = balancing.pick(w.decode.healthy, balancing.decode_load, key)
    assert first is not None
    return first.port, next(e.port for e in w.decode.healthy if e is not first)


@pytest.mark.parametrize("failure", [ConnectionRefusedError(), FakeResponse(503, b"{}")])
def test_direct_retries_a_failing_decoder_and_counts_it(failure: Any) -> None:
    w = World(decode=(D1, D2))
    bad, good = first_choice(w, "k")
    w.up.on(bad, "/v1/completions", failure)
    w.up.on(good, "/v1/completions", FakeResponse(200, completion("ok")))
    down = FakeDownstream()
    c = ctx({"prompt": "hi"})
    c.affinity = "k"
    run(w.direct().serve(c, down))
    assert down.status == 200 and down.json()["choices"][0]["text"] == "ok"
    assert len(w.up.calls) == 2 and w.sample("pd_router_retries_total", pool="decode") == 1
    assert w.load() == [(0, 0)] * 3


def test_direct_hands_back_the_last_engine_error_when_every_decoder_fails() -> None:
    w = World(decode=(D1, D2))
    err = b'{"error":{"message":"engine sick","type":"InternalServerError","code":500}}'
    w.up.on(D1, "/v1/completions", FakeResponse(500, err))
    w.up.on(D2, "/v1/completions", FakeResponse(500, err))
    down = FakeDownstream()
    run(w.direct().serve(ctx({"prompt": "hi"}), down))
    assert (down.status, down.body) == (500, err)
    assert w.sample("pd_router_upstream_errors_total", pool="decode", kind="5xx") == 2
    assert w.load() == [(0, 0)] * 3


def test_a_stream_that_never_sends_its_first_chunk_is_retried_elsewhere() -> None:
    w = World(decode=(D1, D2))
    bad, good = first_choice(w, "k")
    ok = FakeResponse(200, chunks=[b"data: {}\n\n", b"data: [DONE]\n\n"], ctype="text/event-stream")
    w.up.on(bad, "/v1/completions", FakeResponse(200, stall=True, ctype="text/event-stream"))
    w.up.on(good, "/v1/completions", ok)
    down = FakeDownstream()
    c = ctx({"prompt": "hi", "stream": True})
    c.affinity = "k"
    run(w.direct().serve(c, down))
    assert down.events == [b"data: {}\n\n", b"data: [DONE]\n\n"] and down.ended
    assert w.sample("pd_router_upstream_errors_total", pool="decode", kind="timeout") == 1
    assert w.load() == [(0, 0)] * 3


@pytest.mark.parametrize(
    ("down", "outcome"),
    [
        (FakeDownstream(gone_at_end=True), "ok"),  # gone after [DONE]: the answer was whole
        (FakeDownstream(gone_after=1), "client_disconnect"),  # gone mid-answer
    ],
)
def test_a_client_gone_only_after_the_last_byte_was_served(
    down: FakeDownstream, outcome: str
) -> None:
    w = World()
    chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    w.up.on(D1, "/v1/completions", FakeResponse(200, chunks=chunks, ctype="text/event-stream"))
    c = ctx({"prompt": "hi", "stream": True})
    run(w.direct().serve(c, down))
    assert c.outcome == outcome
    assert w.load() == [(0, 0)] * 2


def test_no_healthy_decoder_is_a_503_with_retry_after() -> None:
    w = World(decode=(D1,))
    w.decode.healthy = []
    down = FakeDownstream()
    run(w.direct().serve(ctx({"prompt": "hi"}), down))
    assert down.status == 503 and down.headers["Retry-After"] == "2"


def test_open_decoder_tries_an_avoided_decoder_only_when_nothing_else_is_left() -> None:
    w = World(decode=(D1, D2))
    c = ctx({"prompt": "hi"})
    w.up.on(D2, "/x", FakeResponse(200, b"{}"))
    resp, ep = run(w.legs.open_decoder(c, "/x", b"{}", False, exclude=(w.ep(D1),)))
    assert ep.port == D2
    resp.release()
    w.decode.healthy = [w.ep(D1)]
    w.up.on(D1, "/x", FakeResponse(200, b"{}"))
    resp, ep = run(w.legs.open_decoder(c, "/x", b"{}", False, exclude=(w.ep(D1),)))
    assert ep.port == D1
    resp.release()
    assert w.load() == [(0, 0)] * 3


# ---------------------------------------------------------------------- NIXL
def nixl(w: World) -> NixlRoute:
    d = DirectRoute(w.legs)
    return AsApp(w, NixlRoute(w.legs, d), d)


def test_nixl_prefills_then_hands_the_params_to_the_decoder() -> None:
    w = World()
    w.up.on(P1, "/v1/completions", FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("abc")))
    c = ctx({"prompt": "long", "max_tokens": 9, "stream_options": {"include_usage": True}})
    down = FakeDownstream()
    run(nixl(w).serve(c, down))
    (_, pre), (_, dec) = w.up.calls_to("/v1/completions")
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == PREFILL_PARAMS
    assert dec["kv_transfer_params"] == KVP and dec["max_tokens"] == 9
    assert (
        down.headers["x-pd-route"] == "disaggregated" and down.json()["choices"][0]["text"] == "abc"
    )
    assert w.sample("pd_router_handoff_wait_seconds_count", connector="nixl") == 1
    assert w.load() == [(0, 0)] * 2


def test_nixl_retries_a_failed_decode_without_the_handoff() -> None:
    w = World(decode=(D1, D2))
    w.up.on(P1, "/v1/completions", FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    for d in (D1, D2):
        w.up.on(d, "/v1/completions", ConnectionResetError(), FakeResponse(200, completion("ok")))
    down = FakeDownstream()
    run(nixl(w).serve(ctx({"prompt": "long"}), down))
    decodes = [b for _, b in w.up.calls_to("/v1/completions")[1:]]
    assert "kv_transfer_params" in decodes[0] and "kv_transfer_params" not in decodes[1]
    assert down.headers["x-pd-route"] == "fallback"
    assert w.sample("pd_router_fallbacks_total", reason="decode_retry") == 1
    assert w.load() == [(0, 0)] * 3


ROLE = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n'
)
TOKEN = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_nixl_retries_a_stream_that_ends_with_no_token_without_the_handoff() -> None:
    """vLLM 0.31 fails a request whose NIXL KV load failed as a 200 stream of its role chunk and
    [DONE]: no token, no finish_reason. Relayed, the client would take it for an empty answer."""
    w = World(decode=(D1,))
    w.up.on(P1, "/v1/chat/completions", FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    empty = FakeResponse(200, chunks=[ROLE, DONE], ctype="text/event-stream")
    answer = FakeResponse(200, chunks=[ROLE, TOKEN, DONE], ctype="text/event-stream")
    w.up.on(D1, "/v1/chat/completions", empty, answer)
    down = FakeDownstream()
    run(
        nixl(w).serve(
            ctx({"messages": [{"role": "user", "content": "long"}], "stream": True}, chat=True),
            down,
        )
    )
    decodes = [b for _, b in w.up.calls_to("/v1/chat/completions")[1:]]
    assert "kv_transfer_params" in decodes[0] and "kv_transfer_params" not in decodes[1]
    assert down.events == [ROLE, TOKEN, DONE] and down.headers["x-pd-reason"] == "decode_retry"
    assert w.sample("pd_router_upstream_errors_total", pool="decode", kind="stream") == 1
    assert w.load() == [(0, 0)] * 2


def test_a_failed_handoff_quarantines_its_pair_and_serves_what_waits_on_it_whole() -> None:
    """Two streamed hand-offs from one prefiller wait on one decoder (vLLM: each its own 5 s
    handshake with a side channel nobody answers on); the second fails (500). The first is
    abandoned at once rather than waiting its turn, and both are served whole; neither engine is
    counted failed (the pair is: pd_router.pairs), and the next long prompt is served whole
    without a prefill (``handoff_failing``) while the pair is out (passiveFailureThreshold 1)."""
    w = World(decode=(D1,))
    w.legs.pairs.health = Health(passive_failure_threshold=1)
    path = "/v1/chat/completions"
    for _ in range(2):
        w.up.on(P1, path, FakeResponse(200, completion("a", kv_transfer_params=KVP)))
    held = Held()
    w.up.on(D1, path, held, FakeResponse(500, b"{}"))
    for _ in range(3):
        answer = FakeResponse(200, chunks=[ROLE, TOKEN, DONE], ctype="text/event-stream")
        w.up.on(D1, path, answer)
    route = nixl(w)
    downs = [FakeDownstream() for _ in range(3)]

    def asked(n: int) -> Ctx:
        return ctx({"messages": [{"role": "user", "content": f"long {n}"}], "stream": True}, True)

    async def main() -> None:
        first = asyncio.create_task(route.serve(asked(1), downs[0]))
        await held.reached.wait()  # its decode leg waits on the decoder
        await route.serve(asked(2), downs[1])
        await asyncio.wait_for(first, 5)  # (waited forever, were it not abandoned)
        await route.serve(asked(3), downs[2])

    run(main())
    assert [d.events for d in downs] == [[ROLE, TOKEN, DONE]] * 3
    assert [d.headers["x-pd-reason"] for d in downs] == ["decode_retry"] * 2 + ["handoff_failing"]
    decodes = [b for port, b in w.up.calls_to(path) if port == D1]
    assert ["kv_transfer_params" in b for b in decodes] == [True, True, False, False, False]
    assert len(w.up.calls_to(path)) == 7  # two prefills, five decoder calls: none for the third
    assert w.sample("pd_router_upstream_errors_total", pool="decode", kind="abandoned") == 1
    assert w.sample("pd_router_upstream_errors_total", pool="decode", kind="5xx") == 1
    assert (w.ep(P1).passive_failures, w.ep(D1).passive_failures) == (0, 0)
    assert [e.healthy for e in (w.ep(P1), w.ep(D1))] == [True, True]
    assert w.load() == [(0, 0)] * 2


@pytest.mark.parametrize(
    ("prefill", "reason", "kind"),
    [
        (TimeoutError(), "prefill_timeout", "timeout"),
        (ConnectionRefusedError(), "prefill_error", "connect"),
        (FakeResponse(500, b"{}"), "prefill_error", "5xx"),
        (FakeResponse(200, b"not json"), "prefill_error", "bad_response"),
        (FakeResponse(200, completion("a")), "no_kv_params", "no_kv_params"),
    ],
)
def test_nixl_serves_directly_when_the_prefill_leg_fails(
    prefill: Any, reason: str, kind: str
) -> None:
    w = World()
    w.up.on(P1, "/v1/completions", prefill)
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("whole")))
    down = FakeDownstream()
    c = ctx({"prompt": "long"})
    run(nixl(w).serve(c, down))
    assert down.headers["x-pd-route"] == "fallback" and down.json()["choices"][0]["text"] == "whole"
    assert "kv_transfer_params" not in w.up.calls_to("/v1/completions")[-1][1]
    assert w.sample("pd_router_fallbacks_total", reason=reason) == 1
    assert w.sample("pd_router_upstream_errors_total", pool="prefill", kind=kind) == 1
    assert w.load() == [(0, 0)] * 2


@pytest.mark.parametrize(
    "decoder", [FakeResponse(400, b'{"error":"yours"}'), FakeResponse(200, completion("ok"))]
)
def test_a_prefiller_4xx_is_answered_by_a_decoder_for_the_clients_own_request(
    decoder: FakeResponse,
) -> None:
    """The prefiller refused the leg's body (max_tokens 1, no stream, hand-off fields): vLLM's
    message would speak of a request the client never sent. A decoder gets the client's own."""
    w = World()
    w.up.on(P1, "/v1/completions", FakeResponse(400, b'{"error":"you requested 1 output tokens"}'))
    w.up.on(D1, "/v1/completions", decoder)
    down = FakeDownstream()
    run(nixl(w).serve(ctx({"prompt": "long", "max_tokens": 9}), down))
    sent = w.up.calls_to("/v1/completions")
    assert len(sent) == 2 and sent[1][1] == {"prompt": "long", "max_tokens": 9}
    assert down.status == decoder.status and down.body == b"".join(decoder.chunks)
    assert down.headers["x-pd-reason"] == "prefill_refused"
    assert w.sample("pd_router_fallbacks_total", reason="prefill_refused") == 1
    assert w.load() == [(0, 0)] * 2


# ---------------------------------------------------------------------- LMCache
IDS = [11, 12, 13, 14]


def prefill_answer(tok: int = 99, text: str = "A", finish: str | None = "length") -> FakeResponse:
    return FakeResponse(
        200,
        {
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "kv_transfer_params": {"first_tok": tok},
        },
    )


def lmcache(w: World, waiter: FakeWaiter) -> LMCacheRoute:
    lm = LMCache(decoder_init_ports=[7300, 7301], decoder_alloc_ports=[7400, 7401])
    d = DirectRoute(w.legs)
    return AsApp(w, LMCacheRoute(lm, w.legs, d, waiter, False), d)


def lm_ctx(body: dict[str, Any], chat: bool = False) -> Any:
    c = ctx({"max_tokens": 8, **body}, chat=chat)
    c.ids = IDS
    return c


def test_lmcache_decodes_on_the_decoder_that_received_the_kv() -> None:
    w, waiter = World(decode=(D1, D2)), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", prefill_answer())
    for d in (D1, D2):
        w.up.on(d, "/v1/completions", FakeResponse(200, completion("BCD")))
    down = FakeDownstream()
    c = lm_ctx({"messages": [{"role": "user", "content": "q"}]}, chat=True)
    run(lmcache(w, waiter).serve(c, down))
    (_, pre), (dport, dec) = w.up.calls_to("/v1/completions")
    spec = pre["kv_transfer_params"]["disagg_spec"]
    assert pre["prompt"] == IDS and pre["max_tokens"] == 1
    assert spec["receiver_init_port"] == [7300, 7301] and spec["req_id"] == waiter.expected[0]
    assert dport == w.ep(dport).port and dec["prompt"] == [*IDS, 99] and dec["max_tokens"] == 7
    assert "kv_transfer_params" not in dec and waiter.waited == [(waiter.expected[0], P1)]
    body = down.json()
    # a fresh id in vLLM's format, never the request id (lmcache_answer.new_completion_id)
    assert body["object"] == "chat.completion" and re.fullmatch(
        r"chatcmpl-[0-9a-f]{16}", body["id"]
    )
    assert body["choices"][0]["message"]["content"] == "ABCD"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert down.headers["x-pd-route"] == "disaggregated" and waiter.cancelled
    assert w.load() == [(0, 0)] * 3


def test_lmcache_without_a_notification_decodes_elsewhere_and_counts_the_prefiller() -> None:
    w, waiter = World(decode=(D1, D2)), FakeWaiter("timeout")
    w.up.on(P1, "/v1/completions", prefill_answer())
    for d in (D1, D2):
        w.up.on(d, "/v1/completions", FakeResponse(200, completion("BCD")))
    down = FakeDownstream()
    c = lm_ctx({"prompt": "q"})
    c.affinity = "pin"  # the same decoder every time: the one the KV was meant for
    run(lmcache(w, waiter).serve(c, down))
    pre, dec = w.up.calls_to("/v1/completions")
    receiver = pre[1]["kv_transfer_params"]["disagg_spec"]["receiver_host"]
    assert receiver == "127.0.0.1"
    meant = [e for e in w.decode.endpoints.values() if e.port != dec[0]]
    assert len(meant) == 1  # decoded on the other decoder
    assert down.headers["x-pd-route"] == "fallback" and down.json()["choices"][0]["text"] == "ABCD"
    assert w.sample("pd_router_fallbacks_total", reason="notify_timeout") == 1
    assert w.sample("pd_router_upstream_errors_total", pool="prefill", kind="notify_timeout") == 1
    assert w.load() == [(0, 0)] * 3


def test_lmcache_retries_when_the_kv_holding_decoder_cannot_be_reached() -> None:
    w, waiter = World(decode=(D1, D2)), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", prefill_answer())
    holder, other = first_choice(w, "k")
    w.up.on(holder, "/v1/completions", ConnectionRefusedError())
    w.up.on(other, "/v1/completions", FakeResponse(200, completion("BCD")))
    down = FakeDownstream()
    c = lm_ctx({"prompt": "q"})
    c.affinity = "k"
    run(lmcache(w, waiter).serve(c, down))
    decodes = w.up.calls_to("/v1/completions")[1:]
    assert [port for port, _ in decodes] == [holder, other]
    assert down.json()["choices"][0]["text"] == "ABCD"
    assert w.sample("pd_router_retries_total", pool="decode") == 1
    assert w.load() == [(0, 0)] * 3


def test_lmcache_answers_a_stopped_first_token_without_a_decode_leg() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", prefill_answer(text="!", finish="stop"))
    down = FakeDownstream()
    run(
        lmcache(w, waiter).serve(
            lm_ctx({"prompt": "q", "stream": True, "stream_options": {"include_usage": True}}), down
        )
    )
    chunks = down.sse()
    assert (
        chunks[0]["choices"][0]["text"] == "!"
        and chunks[0]["choices"][0]["finish_reason"] == "stop"
    )
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    assert len(w.up.calls) == 1 and waiter.waited == [] and down.ended
    assert w.load() == [(0, 0)] * 2


def test_lmcache_streams_the_first_token_then_the_relabelled_decode_leg() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", prefill_answer())
    leg = [
        b'data: {"id":"cmpl-engine","object":"text_completion","created":1,"model":"m",'
        b'"choices":[{"index":0,"text":"B","finish_reason":null}]}\n\ndata: {"id":"cmpl-en',
        b'gine","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
        b'"text":"C","finish_reason":"length"}]}\n\ndata: [DONE]\n\n',
    ]
    w.up.on(D1, "/v1/completions", FakeResponse(200, chunks=leg, ctype="text/event-stream"))
    down = FakeDownstream()
    c = lm_ctx({"messages": [{"role": "user", "content": "q"}], "stream": True}, chat=True)
    run(lmcache(w, waiter).serve(c, down))
    chunks = down.sse()
    # vLLM's role-only first chunk, then the prefiller's token, then the decode leg's
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ch["choices"][0].get("delta", {}).get("content") for ch in chunks] == [
        "",
        "A",
        "B",
        "C",
    ]
    assert len({ch["id"] for ch in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert "rid1" not in chunks[0]["id"]
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    assert b"".join(down.events).endswith(b"data: [DONE]\n\n") and down.ended
    assert w.load() == [(0, 0)] * 2


def test_lmcache_client_leaving_at_the_first_chunk_releases_everything() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", prefill_answer())
    down = FakeDownstream(gone_after=0)
    run(lmcache(w, waiter).serve(lm_ctx({"prompt": "q", "stream": True}), down))
    assert w.sample("pd_router_client_disconnects_total") == 1
    assert set(waiter.cancelled) == set(waiter.expected) and waiter.waited == []
    assert w.load() == [(0, 0)] * 2


@pytest.mark.parametrize(
    ("body", "ids", "reason"),
    [
        ({"prompt": "q", "echo": True}, IDS, "unsupported_fields"),
        ({"prompt": "q", "min_tokens": 50}, IDS, "unsupported_fields"),
        ({"prompt": "q", "max_tokens": 5000}, list(range(100)), "too_long"),
        ({"prompt": "q"}, None, "tokenize_error"),
    ],
)
def test_lmcache_falls_back_before_any_prefill(body: dict[str, Any], ids: Any, reason: str) -> None:
    w, waiter = World(), FakeWaiter("ok")
    # an unknown context length sends the router to /tokenize (which learns it)
    w.legs.model.max_model_len = None if ids is None else 4096
    w.up.on(P1, "/tokenize", FakeResponse(500, b"{}"))
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("whole")))
    c = ctx(body)
    c.ids = ids
    down = FakeDownstream()
    run(lmcache(w, waiter).serve(c, down))
    assert down.headers["x-pd-route"] == "fallback" and not waiter.expected
    assert [p for _, p, _ in w.up.calls if p == "/v1/completions"] == ["/v1/completions"]
    assert w.sample("pd_router_fallbacks_total", reason=reason) == 1
    assert w.load() == [(0, 0)] * 2


def ids_answer(chat: bool, ids: Any, tok: int = 99, text: str = "A") -> FakeResponse:
    """A prefill leg's answer with ``return_token_ids``, where vLLM 0.31 puts the prompt's
    ids: the chat response, or the completion's choice."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": [tok]}
    answer: dict[str, Any] = {"choices": [choice], "kv_transfer_params": {"first_tok": tok}}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        answer["prompt_token_ids"] = ids
    else:
        choice.update(text=text, prompt_token_ids=ids)
    return FakeResponse(200, answer)


@pytest.mark.parametrize("chat", [False, True])
def test_lmcache_learns_the_ids_from_the_prefill_leg_without_tokenize(chat: bool) -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.legs.model.max_model_len = 4096
    path = "/v1/chat/completions" if chat else "/v1/completions"
    w.up.on(P1, path, ids_answer(chat, IDS))
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("BCD")))
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"}
    )
    c = ctx({**prompt, "max_tokens": 8, "stream_options": None}, chat=chat)
    c.ptok = 3
    down = FakeDownstream()
    run(lmcache(w, waiter).serve(c, down))
    (pport, ppath, pre), (_, dpath, dec) = w.up.calls
    assert (pport, ppath) == (P1, path) and "/tokenize" not in [p for _, p, _ in w.up.calls]
    # the client's own prompt, one token, asking for its ids
    assert {k: pre[k] for k in prompt} == prompt and pre["return_token_ids"] is True
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert dpath == "/v1/completions" and dec["prompt"] == [*IDS, 99] and dec["max_tokens"] == 7
    text = down.json()["choices"][0]
    assert (text["message"]["content"] if chat else text["text"]) == "ABCD"
    assert down.json()["usage"]["prompt_tokens"] == 4
    assert down.headers["x-pd-route"] == "disaggregated" and w.load() == [(0, 0)] * 2


def test_lmcache_too_long_learnt_from_the_prefill_leg_is_decoded_unsplit() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.legs.model.max_model_len = 100
    w.up.on(P1, "/v1/completions", ids_answer(False, list(range(98))))
    w.up.on(D1, "/v1/completions", FakeResponse(400, b'{"error":"too long"}'))
    down = FakeDownstream()
    run(lmcache(w, waiter).serve(ctx({"prompt": "q", "max_tokens": 8}), down))
    assert down.headers["x-pd-route"] == "fallback" and down.status == 400
    assert w.sample("pd_router_fallbacks_total", reason="too_long") == 1
    assert set(waiter.cancelled) == set(waiter.expected) and w.load() == [(0, 0)] * 2


def test_lmcache_prefill_answer_without_the_prompt_ids_is_a_bad_response() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.legs.model.max_model_len = 4096
    w.up.on(P1, "/v1/completions", ids_answer(False, None))
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("whole")))
    down = FakeDownstream()
    run(lmcache(w, waiter).serve(ctx({"prompt": "q", "max_tokens": 8}), down))
    assert down.headers["x-pd-route"] == "fallback"
    assert w.sample("pd_router_upstream_errors_total", pool="prefill", kind="bad_response") == 1


def test_lmcache_prefill_failure_falls_back_and_gives_the_decoder_back() -> None:
    w, waiter = World(), FakeWaiter("ok")
    w.up.on(P1, "/v1/completions", prefill_answer(tok="x"))  # type: ignore[arg-type]
    w.up.on(D1, "/v1/completions", FakeResponse(200, completion("whole")))
    down = FakeDownstream()
    run(lmcache(w, waiter).serve(lm_ctx({"prompt": "q"}), down))
    assert down.headers["x-pd-route"] == "fallback"
    assert w.sample("pd_router_upstream_errors_total", pool="prefill", kind="bad_response") == 1
    assert set(waiter.cancelled) == set(waiter.expected) and w.load() == [(0, 0)] * 2


def test_leg_errors_say_what_the_client_gets() -> None:
    assert (LegError.of(TimeoutError()).kind, LegError.of(TimeoutError()).status) == (
        "timeout",
        504,
    )
    assert (LegError.of(OSError(), "stream").kind, LegError.of(OSError()).status) == ("stream", 502)
    assert LegError.no_decoder().status == 503
    assert orjson.loads(b"{}") == {}


# ---------------------------------------------------------------------- how a request ended
class _Sent:
    """The server's response object under a Downstream: ``fail`` names the call that finds
    the client gone."""

    prepared = True

    def __init__(self, fail: str = "") -> None:
        self.fail = fail

    async def write(self, data: bytes) -> None:
        if self.fail == "write":
            raise ConnectionResetError

    async def write_eof(self) -> None:
        if self.fail in ("write", "eof"):
            raise ConnectionResetError


@pytest.mark.parametrize(
    ("fail", "outcome"),
    [("", "ok"), ("eof", "ok"), ("write", "client_disconnect")],
)
def test_the_downstream_records_how_a_stream_ended(fail: str, outcome: str) -> None:
    """The one place an outcome comes from: a client gone after the last byte, before the end
    marker (the openai client closes on [DONE]), still got the whole answer."""

    c = ctx({"prompt": "hi", "stream": True})
    down = Downstream(None, c)  # type: ignore[arg-type]
    down.response = _Sent(fail)  # type: ignore[assignment]

    async def stream() -> None:
        try:
            await down.write(b"data: {}\n\ndata: [DONE]\n\n")
            await down.end()
        except ClientGone:
            pass

    run(stream())
    assert c.outcome == outcome
    assert (c.t_end > 0) == (outcome == "ok")


@pytest.mark.parametrize(
    ("status", "outcome"), [(200, "ok"), (400, "client_error"), (503, "upstream_error")]
)
def test_a_whole_answer_is_judged_by_its_status(status: int, outcome: str) -> None:

    c = ctx({"prompt": "hi"})
    Downstream(None, c).reply(status, b"{}", {})  # type: ignore[arg-type]
    assert c.outcome == outcome and (c.t_first > 0) == (status < 400)


def test_a_request_that_ended_with_nothing_recorded_is_counted_as_an_internal_error() -> None:
    w = World()

    class Broken:
        async def serve(self, c: Ctx, down: Any) -> Any:
            raise RuntimeError("a router bug")

    c = ctx({"prompt": "hi"})
    with pytest.raises(RuntimeError):
        run(AsApp(w, Broken(), w.direct().direct).serve(c, FakeDownstream()))
    assert w.sample("pd_router_requests_total", route="direct", outcome="internal_error") == 1
