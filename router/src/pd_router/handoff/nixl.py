"""vLLM NixlConnector hand-off (stateless): prefill with ``do_remote_decode``, then send the
decoder the original request with the ``kv_transfer_params`` the prefiller returned.

First written against vLLM v0.11 ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
and ``nixl_connector.py``; run against vLLM 0.31.0 itself (its CPU build, tests/real_engine/,
answers equal to colocated token for token) and checked with 0.31.0's and 0.33.0's request
models (tests/engines/test_engine_vllm_requests.py): the prefill request is
the original with ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1``),
``stream_options`` removed; its response carries top-level ``kv_transfer_params``
(``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_host``,
``remote_port``, ``remote_request_id``...), passed to the decoder unchanged.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from pd_router import revision
from pd_router.config import RouterConfig
from pd_router.handoff.direct import DirectRoute
from pd_router.http1 import Answer
from pd_router.legs import Downstream, Legs
from pd_router.lengths import lower_min_tokens, min_tokens_above, requested_max_tokens
from pd_router.request import DISAGG, Ctx, Fallback

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    req = dict(body)
    req["stream"] = False
    req.pop("stream_options", None)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    lower_min_tokens(req, produced=0, limit=1)
    req["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return req


def decode_params(prefill_response: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` to hand to the decoder, or None if the prefiller sent none."""
    if not isinstance(prefill_response, dict):
        return None
    kvp = prefill_response.get("kv_transfer_params")
    if not isinstance(kvp, dict) or not kvp:
        return None
    return kvp


def decode_body(body: dict[str, Any], kvp: dict[str, Any]) -> dict[str, Any]:
    req = dict(body)
    req["kv_transfer_params"] = kvp
    return req


def build_route(cfg: RouterConfig, legs: Legs, direct: DirectRoute) -> NixlRoute:
    """The hand-off of ``routing.connector: nixl`` (pd_router.connectors): nothing to build
    but the route."""
    return NixlRoute(legs, direct)


class NixlRoute:
    def __init__(self, legs: Legs, direct: DirectRoute) -> None:
        self.legs = legs
        self.direct = direct

    async def start(self) -> None:  # nothing to start (pd_router.handoff.Route)
        pass

    async def stop(self) -> None:
        pass

    async def serve(self, ctx: Ctx, down: Downstream) -> Answer:
        """Prefill, then decode with the prefiller's params; raises :class:`Fallback` while
        nothing has reached the client (pd_router.handoff.run serves it directly)."""
        legs, body = self.legs, ctx.body
        if min_tokens_above(body, requested_max_tokens(body, ctx.chat)):
            # invalid as sent (vLLM answers 400): no prefill for it
            raise Fallback("unsupported_fields")
        # (the prefix index was told of the decision's decoder; another one is chosen only
        # while both roles roll, or when the decision's engine left the pool)
        dec, ep = legs.pair(ctx, ctx.prefiller)
        ctx.route = DISAGG
        t0 = time.perf_counter()
        # prefiller load: the prompt length as the decision saw it, else bytes / 4
        ntok = ctx.ptok or len(ctx.raw) // 4
        pbody = revision.leg_model(prefill_body(body), legs.served, ep.revision)
        answer = await legs.prefill(ctx, ep, ctx.path, pbody, ntok)
        # (a NIXL prefill has proved itself once a decoder read its KV: Legs._decoder_attempt)
        kvp = decode_params(answer)
        if kvp is None:
            legs.outcomes.upstream("prefill", "no_kv_params")
            raise Fallback("no_kv_params")
        legs.outcomes.handoff_wait("nixl", time.perf_counter() - t0)
        kvbody = decode_body(body, kvp)
        dbody = revision.leg_model(kvbody, legs.served, dec.revision)
        # A retry goes out without the hand-off: the failed decoder may already have pulled
        # the blocks, and the prefiller frees them once pulled (vLLM v0.11 NixlConnector), so
        # the next decoder recomputes the prompt instead of reading blocks that may be reused.
        return await self.direct.send(
            ctx,
            down,
            orjson.dumps(dbody),
            retry_data=ctx.raw,
            named=dbody is not kvbody,
            kv_source=ep,
        )
