"""The served model as the engines describe it: its cards for ``GET /v1/models`` (asked of the
engines at most once a TTL, the last good answer kept) and its context length,
``max_model_len``, learnt from a card or from ``/tokenize``: the one place that knows it (the
LMCache route sizes its decode leg's ``max_tokens`` by it; the router's own card shows it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import orjson

from pd_router.discovery import Endpoint
from pd_router.failures import UPSTREAM_ERRORS
from pd_router.openai_wire import model_card, served_cards
from pd_router.upstream import UpstreamClient

log = logging.getLogger("pd_router")

# How long an engine's /v1/models answer is reused, and how soon one is asked again after no
# engine answered (a router asked before its first health checks passed recovers quickly).
MODELS_TTL_SECONDS = 10.0
MODELS_RETRY_SECONDS = 1.0
ASKED = 2  # engines asked for their cards, decoders first, before the router answers its own


class ServedModel:
    def __init__(self, name: str, adapters: Sequence[str] = ()) -> None:
        self.name = name  # model.servedName
        self.adapters = frozenset(adapters)  # model.adapters: their cards are listed too
        self.max_model_len: int | None = None  # unknown until an engine says it
        self._cards: list[dict[str, Any]] = []  # the last good answer
        self._ok = False  # whether the last ask got one
        self._at = -MODELS_TTL_SECONDS  # monotonic time of the last ask
        self._lock = asyncio.Lock()

    def learn(self, max_model_len: Any) -> None:
        """An engine said its context length (in its card, or /tokenize's answer)."""
        if type(max_model_len) is int and max_model_len > 0:
            self.max_model_len = max_model_len

    async def cards(
        self, up: UpstreamClient, engines: Sequence[Endpoint], timeout: float
    ) -> tuple[list[dict[str, Any]], str]:
        """The served model's cards and where they come from: ``engine`` (an engine's answer
        of the last MODELS_TTL_SECONDS), ``stale`` (no engine answers now: the last answer
        one gave), ``router`` (no engine ever answered: the router's own card, with the
        context length learnt from /tokenize when known). Engines are asked again
        MODELS_RETRY_SECONDS after an ask that got no card; ``engines``: the healthy ones,
        decoders first, each asked within ``timeout``."""
        if time.monotonic() - self._at >= self._ttl():
            async with self._lock:  # one ask at a time; the others reuse its answer
                if time.monotonic() - self._at >= self._ttl():
                    cards = await self._ask(up, engines[:ASKED], timeout)
                    self._at = time.monotonic()
                    self._ok = bool(cards)
                    if cards:
                        self._cards = cards
        if self._ok:
            return self._cards, "engine"
        if self._cards:
            return self._cards, "stale"
        return [model_card(self.name, self.max_model_len, int(time.time()))], "router"

    def _ttl(self) -> float:
        return MODELS_TTL_SECONDS if self._ok else MODELS_RETRY_SECONDS

    async def _ask(
        self, up: UpstreamClient, engines: Sequence[Endpoint], t: float
    ) -> list[dict[str, Any]]:
        """``GET /v1/models`` of each engine in turn; [] when none answers with a card of the
        served model."""
        for ep in engines:
            try:
                async with asyncio.timeout(t):
                    r = await up.get(ep.host, ep.port, ep.tls, "/v1/models", b"", t, t)
                    raw = await r.read_release()
                cards = []
                if r.status == 200:
                    cards = served_cards(orjson.loads(raw), self.name, self.adapters)
            except (*UPSTREAM_ERRORS, orjson.JSONDecodeError) as exc:
                log.warning("GET %s/v1/models failed: %r", ep.base, exc)
                continue
            if cards:
                self.learn(cards[0].get("max_model_len"))  # what /tokenize would teach
                return cards
            log.warning(
                "GET %s/v1/models (%d) lists no model %r (model.servedName)",
                ep.base,
                r.status,
                self.name,
            )
        return []
