"""The direct route: one decoder prefills and decodes. Also where every disaggregated request
ends up when its hand-off cannot be used (route ``fallback``, reason counted), and how vLLM's
other endpoints reach a decoder (:meth:`DirectRoute.passthrough`)."""

from __future__ import annotations

from pd_router.discovery import Endpoint
from pd_router.failures import LegError
from pd_router.http1 import Answer
from pd_router.legs import Downstream, Legs
from pd_router.request import Ctx


class DirectRoute:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def start(self) -> None:  # nothing to start (pd_router.handoff.Route)
        pass

    async def stop(self) -> None:
        pass

    async def serve(self, ctx: Ctx, down: Downstream) -> Answer:
        return await self.send(ctx, down, ctx.raw)

    async def send(
        self,
        ctx: Ctx,
        down: Downstream,
        data: bytes,
        retry_data: bytes | None = None,
        named: bool = False,
        kv_source: Endpoint | None = None,
    ) -> Answer:
        """``data`` to a decoder (retries send ``retry_data`` when given; ``named``: ``data``
        names a KV revision; ``kv_source``: the engine that prefilled it: Legs.open_decoder),
        relayed back."""
        legs = self.legs
        try:
            resp, ep = await legs.open_decoder(
                ctx,
                ctx.path,
                data,
                ctx.stream,
                retry_data=retry_data,
                named=named,
                kv_source=kv_source,
            )
        except LegError as err:
            return legs.fail(ctx, down, err)
        return await legs.relay(ctx, down, resp, ep, ctx.stream)

    async def passthrough(self, ctx: Ctx, down: Downstream) -> Answer:
        """One of vLLM's other endpoints (``openai_wire.PASSTHROUGH_PATHS``): ``ctx.raw`` to
        ``ctx.path`` on a decoder, retried like a completion; the answer relayed as it comes,
        a stream when the engine answers ``text/event-stream`` (the Responses API,
        transcriptions, ... decide that from their own fields)."""
        legs = self.legs
        try:
            resp, ep = await legs.open_decoder(ctx, ctx.path, ctx.raw, ctx.stream)
        except LegError as err:
            return legs.fail(ctx, down, err)
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        return await legs.relay(ctx, down, resp, ep, sse)
