"""The routes a request can take, each one module with one entry, ``serve(ctx, down)``:

- :mod:`.direct`: one decoder prefills and decodes (short prompts, and every fallback);
- :mod:`.nixl`: vLLM's NixlConnector hand-off (prefill, then decode with the returned params);
- :mod:`.lmcache`: LMCache PD (decoder chosen first, prefill pushes the KV, decode the rest).

The hand-off is chosen once, at start-up, from ``routing.connector``: :func:`build_route`
asks the module pd_router.connectors names for it, whose own ``build_route`` also builds what
that hand-off needs (LMCache's notification waiter); no request asks which connector is
configured, and the app knows none. A route returns the client's answer or
raises: :class:`~pd_router.request.Fallback` (the hand-off cannot serve it: one decoder does,
its reason counted) or :class:`~pd_router.failures.LegError` while nothing was sent (no engine
can: the client's error answer). :func:`run` is the one place that turns either into an
answer.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from pd_router.config import RouterConfig
from pd_router.connectors import CONNECTORS
from pd_router.failures import LegError
from pd_router.handoff.direct import DirectRoute
from pd_router.http1 import Answer
from pd_router.legs import Downstream, Legs
from pd_router.request import Ctx, Fallback


class Route(Protocol):
    async def serve(self, ctx: Ctx, down: Downstream) -> Answer: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def build_route(cfg: RouterConfig, legs: Legs, direct: DirectRoute) -> Route:
    """The disaggregated route of this router: ``routing.connector``'s module builds it."""
    module = importlib.import_module(CONNECTORS[cfg.routing.connector].route)
    route: Route = module.build_route(cfg, legs, direct)
    return route


async def run(route: Route, direct: DirectRoute, ctx: Ctx, down: Downstream) -> Answer:
    """``route`` serves ``ctx`` to its end: a fallback it raises is served by one decoder (its
    reason counted), a leg error before any byte is the client's error answer."""
    try:
        return await route.serve(ctx, down)
    except Fallback as fb:
        direct.legs.outcomes.fallback(ctx, fb.reason)
        tr = ctx.trace
        if tr is None:
            return await direct.serve(ctx, down)
        # traced: the one decoder's legs hang from a span naming why
        span = tr.current = tr.span("fallback", attrs={"pd.fallback.reason": fb.reason})
        try:
            return await direct.serve(ctx, down)
        finally:
            tr.end(span)
            tr.current = tr.root
    except LegError as err:
        return direct.legs.fail(ctx, down, err)


__all__ = ["DirectRoute", "Route", "build_route", "run"]
