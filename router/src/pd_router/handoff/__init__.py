"""The routes a request can take, each one module with one entry, ``serve(ctx, down)``:

- :mod:`.direct`: one decoder prefills and decodes (short prompts, and every fallback);
- :mod:`.nixl`: vLLM's NixlConnector hand-off (prefill, then decode with the returned params);
- :mod:`.lmcache`: LMCache PD (decoder chosen first, prefill pushes the KV, decode the rest).

The hand-off is chosen once, at start-up, from ``routing.connector`` (:func:`build_route`);
no request asks which connector is configured.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from pd_router.config import RouterConfig
from pd_router.handoff.direct import DirectRoute
from pd_router.handoff.lmcache import LMCacheRoute
from pd_router.handoff.lmcache_notify import KvWaiter
from pd_router.handoff.nixl import NixlRoute
from pd_router.legs import Downstream, Legs
from pd_router.request import Ctx


class Route(Protocol):
    async def serve(self, ctx: Ctx, down: Downstream) -> web.StreamResponse: ...


def build_route(
    cfg: RouterConfig, legs: Legs, direct: DirectRoute, waiter: KvWaiter | None
) -> Route:
    """The disaggregated route of this router (``routing.connector``)."""
    if cfg.routing.connector == "lmcache":
        assert waiter is not None
        return LMCacheRoute(cfg.lmcache, legs, direct, waiter)
    return NixlRoute(legs, direct)


__all__ = ["DirectRoute", "Route", "build_route"]
