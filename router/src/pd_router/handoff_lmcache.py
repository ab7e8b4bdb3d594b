"""LMCache PD hand-off (LMCacheConnectorV1, ``enable_pd``) - proxy side.

Checked against LMCache 0.5.6 (``examples/disagg_prefill/disagg_proxy_server.py`` and
``lmcache/v1/storage_backend/pd_backend.py``) and pd-protocols.md section 1:

1. the decoder is chosen first; its host and per-TP-rank receiver ports go into
   ``kv_transfer_params.disagg_spec`` of a NON-streaming ``/v1/completions`` prefill request
   whose ``prompt`` is the token ids and ``max_tokens`` is 1, with ``ret_first_tok`` present;
2. the prefill response carries ``kv_transfer_params.first_tok``;
3. every prefill TP rank PUSHes one msgspec ``ProxyNotif(req_id)`` to the proxy's PULL socket
   once its chunks landed (a failed transfer sends none);
4. then the decoder gets ``prompt = ids + [first_tok]``, ``max_tokens - 1``, no
   ``kv_transfer_params``.

Several router replicas: the notification goes to ONE host. With
``lmcache.notificationReceiver: router`` this process binds it (:class:`NotifyListener`), so
only one router replica can work; with ``prefillSidecar`` a ``pd-router notify-sidecar`` in
every prefill pod receives them and the router asks the sidecar of the prefill pod it used
(:func:`sidecar_wait`), keeping no state another replica would need. Either way, a missing
notification times out and the request is decoded anyway ("fallback", counted) on a decoder
other than the one that may hold a partial KV; in router mode, notifications for unknown or
expired request ids are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl
import zmq
import zmq.asyncio

from pd_router.lengths import lower_min_tokens
from pd_router.lmcache_wire import receive_notifications
from pd_router.metrics import Metrics

log = logging.getLogger("pd_router.lmcache")

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


class _Waiter:
    __slots__ = ("future", "remaining")

    def __init__(self, future: asyncio.Future[None], remaining: int) -> None:
        self.future = future
        self.remaining = remaining


class NotifyListener:
    """ZMQ PULL socket receiving LMCache ProxyNotif messages, matched to waiting requests."""

    def __init__(self, bind_host: str, port: int, per_request: int, metrics: Metrics) -> None:
        self.bind_host = bind_host
        self.port = port
        self.per_request = per_request
        self.metrics = metrics
        self.waiters: dict[str, _Waiter] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100000)
        host = "*" if self.bind_host in ("0.0.0.0", "", "*") else self.bind_host
        try:
            self._sock.bind(f"tcp://{host}:{self.port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            msg = f"cannot bind lmcache.notifyPort on {self.bind_host}:{self.port}: {exc}"
            raise OSError(msg) from None
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())
        log.info("LMCache notification PULL socket bound on %s:%d", self.bind_host, self.port)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        unknown = self.metrics.notifications.labels("unknown")
        matched = self.metrics.notifications.labels("matched")

        def on_req_id(req_id: str) -> None:
            w = self.waiters.get(req_id)
            if w is None or w.future.done():
                unknown.inc()  # expired (timed out), unknown, or a duplicate: drop
                log.debug("dropped notification for unknown req_id %r", req_id)
                return
            matched.inc()
            w.remaining -= 1
            if w.remaining <= 0:
                del self.waiters[req_id]
                w.future.set_result(None)

        await receive_notifications(
            self._sock, on_req_id, self.metrics.notifications.labels("malformed")
        )

    def expect(self, req_id: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters[req_id] = _Waiter(fut, self.per_request)
        return fut

    def cancel(self, req_id: str) -> None:
        w = self.waiters.pop(req_id, None)
        if w is not None and not w.future.done():
            w.future.cancel()

    async def wait(self, req_id: str, fut: asyncio.Future[None], timeout: float) -> bool:
        """True when all notifications arrived; False on timeout (the waiter is removed, so
        later notifications for this id count as unknown)."""
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.cancel(req_id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()


SIDECAR_MARGIN_SECONDS = 2.0


def sidecar_url(host: str, port: int, req_id: str, count: int, timeout: float) -> yarl.URL:
    h = f"[{host}]" if ":" in host else host
    rid = quote(req_id, safe="")
    return yarl.URL(
        f"http://{h}:{port}/v1/notifications/{rid}?count={count}&timeout={timeout!r}",
        encoded=True,
    )


async def sidecar_wait(
    session: aiohttp.ClientSession,
    host: str,
    port: int,
    req_id: str,
    count: int,
    timeout: float,
    connect_timeout: float,
) -> str:
    """Ask the notification sidecar of a prefill pod to wait for ``count`` notifications of
    ``req_id``: ``"ok"`` (200), ``"timeout"`` (504) or ``"error"`` (anything else, including
    an unreachable sidecar). Bounded by ``timeout`` plus a small margin."""
    ct = aiohttp.ClientTimeout(total=timeout + SIDECAR_MARGIN_SECONDS, sock_connect=connect_timeout)
    try:
        async with session.get(sidecar_url(host, port, req_id, count, timeout), timeout=ct) as r:
            await r.read()
            if r.status == 200:
                return "ok"
            log.warning("notification sidecar %s:%d answered %d", host, port, r.status)
            return "timeout" if r.status == 504 else "error"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.warning("notification sidecar %s:%d failed: %r", host, port, exc)
        return "error"


def completion_to_chat_chunk(chunk: dict[str, Any], rid: str) -> dict[str, Any]:
    """Rewrite a streamed ``text_completion`` chunk as a ``chat.completion.chunk``."""
    choices = []
    for c in chunk.get("choices") or []:
        choices.append(
            {
                "index": c.get("index", 0),
                "delta": {"content": c.get("text", "")},
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
        )
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": chunk.get("created"),
        "model": chunk.get("model"),
        "choices": choices,
    }
    if chunk.get("usage") is not None:
        out["usage"] = adjust_usage(chunk["usage"])
    return out


def adjust_usage(usage: Any) -> Any:
    """The decode leg saw the first token as prompt: move it back to the completion."""
    if not isinstance(usage, dict):
        return usage
    u = dict(usage)
    if isinstance(u.get("prompt_tokens"), int) and u["prompt_tokens"] > 0:
        u["prompt_tokens"] -= 1
    if isinstance(u.get("completion_tokens"), int):
        u["completion_tokens"] += 1
    return u
