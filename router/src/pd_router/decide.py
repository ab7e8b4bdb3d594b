"""The routing decision: is this request disaggregated (prefill, then decode) or served by one
decoder, which decoder, and why (``x-pd-reason``, ``pd_router_decisions_total``). Pure but
for the injected ``tokenize`` (an engine's /tokenize): it reads the pools' load and the prefix
index and changes neither, so it is unit-tested without processes.

The counting ladder, cheapest exact-enough first (pd_router.tokens explains each bound):
``n > 1`` or a batched prompt -> direct (``skipped``; the hand-offs carry one sequence);
threshold 0 -> disaggregated without counting (``skipped``); token-id prompt -> its length
(``tokens``); UTF-8 bytes + template allowance below the threshold -> direct (``bound``); the
local tokenizer: a sampled estimate far enough from the threshold (``sampled``: one window
when the prompt is far beyond it, three when nearer), else the exact count, off the event
loop for long texts (``tokenizer``); the engine's /tokenize (``engine``; its ids are reused by
the LMCache prefill leg); bytes / 4 when nothing answered (``estimate``).

Then ``routing.decision``:

- ``length`` (SageMaker HyperPod's ``routingThreshold`` rule): the prompt's length alone;
  the route's balancer picks the decoder.
- ``prefix`` (the default): the decoder is chosen first, the one the prefix index says holds
  the longest leading part of the prompt (unless it is ``maxLoadImbalance`` requests busier
  than the least busy; with session affinity, the session's decoder); only the prompt tokens
  it does not hold count against the threshold (llm-d's and Dynamo's "effective input
  length"). A long prompt is served directly when the whole prefill pool is busy
  (``prefillBusy.queuedTokens`` prompt tokens in flight on each prefiller) and that decoder
  has fewer than ``prefillBusy.maxDecoderRequests`` requests in flight.

Reasons (``pd_router.metrics.DECIDED``): ``batch``, ``always`` (threshold 0),
``below_threshold``, ``prefix_cached``, ``prefill_busy``, ``above_threshold``; a route that then
cannot disaggregate replaces it with its fallback reason (``no_prefiller``, ...).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from pd_router import balancing
from pd_router.config import Routing
from pd_router.costs import DEFAULT_OUTPUT_TOKENS, CostModel, Meter
from pd_router.discovery import Endpoint
from pd_router.failures import TokenizeError
from pd_router.kv_events import Identity, KvEventIndex, identity_of
from pd_router.lengths import requested_max_tokens
from pd_router.openai_wire import is_batch
from pd_router.pairs import HandoffPairs
from pd_router.plan import Option, Planner
from pd_router.prefix import BYTES_PER_TOKEN, Blocks, PrefixIndex, identity
from pd_router.tokens import (
    INLINE_BYTES,
    TokenCounter,
    prompt_text,
    template_allowance,
    token_ids_prompt,
)

Tokenize = Callable[[dict[str, Any], bool], Awaitable[list[int]]]


@dataclass(frozen=True, slots=True)
class Count:
    source: str  # pd_router_token_count_source_total label
    tokens: int  # the prompt size observed (exact or estimated)
    exact: bool = False
    ids: list[int] | None = None  # the prompt's token ids, when they were learnt
    allowance: int = 0  # the template tokens ``tokens`` allows for (an upper bound)

    @property
    def text_tokens(self) -> int:
        """The prompt's tokens but the template's, at least (what the prefix index weighs its
        blocks by: too few only under-claims a decoder's cache)."""
        return max(0, self.tokens - self.allowance)


@dataclass(frozen=True, slots=True)
class Decision:
    disaggregate: bool
    source: str  # pd_router_token_count_source_total label
    reason: str  # pd_router.metrics.DECIDED
    tokens: int | None = None  # the prompt size observed (exact or estimated); None: uncounted
    exact: bool = False  # ``tokens`` is the exact prompt length
    ids: list[int] | None = None  # the prompt's token ids, when they were learnt
    decoder: Endpoint | None = None  # chosen first (prefix mode); None: the route's balancer
    matched: int = 0  # prompt tokens the decoder is taken to hold already (whole engine blocks)
    blocks: Blocks | None = None  # what to record on the decoder that is sent the prompt
    # where ``matched`` comes from: "events" (the engines' KV events), "approximate" (the
    # router's own index, pd_router.prefix), "" (not estimated)
    estimate: str = ""
    prefiller: Endpoint | None = None  # the prefiller holding the longest prefix (events only)
    # decision goodput: the option taken, with its predictions, and the prompt tokens each
    # engine weighed was taken to hold (pd_router.plan)
    option: Option | None = None
    held: dict[str, int] | None = None
    meter: Meter | None = None  # ties the request's engine calls to the cost model


@dataclass(frozen=True, slots=True)
class Exact:
    """The prompt as the engines hold it: its token ids as vLLM renders them and the rest of
    its blocks' identity (pd_router.kv_events)."""

    ids: list[int]
    ident: Identity


@dataclass(frozen=True, slots=True)
class Pools:
    """The healthy engines at decision time and the request's session affinity key."""

    decoders: Sequence[Endpoint]
    prefillers: Sequence[Endpoint]
    affinity: str | None = None


class Decider:
    def __init__(
        self,
        routing: Routing,
        counter: TokenCounter,
        events: KvEventIndex | None = None,
        costs: CostModel | None = None,
        pairs: HandoffPairs | None = None,
    ) -> None:
        self.threshold = routing.threshold
        self.counter = counter
        pc = routing.prefix_cache
        # the goodput decision reads what the engines hold as the prefix decision does
        prefix = routing.decision in ("prefix", "goodput")
        self.costs = costs if routing.decision == "goodput" else None
        self.planner = Planner(costs, pairs) if self.costs is not None else None
        self.index = PrefixIndex(pc.capacity_tokens) if prefix else None
        self.imbalance = pc.max_load_imbalance
        self.busy_tokens = routing.prefill_busy.queued_tokens
        self.max_decoder_requests = routing.prefill_busy.max_decoder_requests
        # the engines' KV events (routing.kvEvents): exact where an engine's picture is
        self.events = events if prefix else None
        self.base_names: tuple[str, ...] = ()  # the base model's names (not a LoRA adapter)
        self.adapters: frozenset[str] = frozenset()  # the LoRA adapters served (model.adapters)

    async def decide(
        self, body: dict[str, Any], chat: bool, tokenize: Tokenize, pools: Pools
    ) -> Decision:
        """``tokenize(body, chat)``: the exact ids from an engine, or TokenizeError."""
        th = self.threshold
        if is_batch(body, chat):
            return Decision(False, "skipped", "batch")
        if self.planner is not None:
            return await self._goodput(body, chat, tokenize, pools)
        if th == 0:
            return Decision(True, "skipped", "always")
        c = await self._count(body, chat, tokenize)
        index = self.index
        if index is None:
            long = c.tokens >= th
            reason = "above_threshold" if long else "below_threshold"
            return Decision(long, c.source, reason, c.tokens, c.exact, c.ids)
        # a text prompt by what it renders from, even when its ids are known: one key space
        # per prompt kind (pd_router.prefix.identity)
        seed, data = identity(body, chat, self._adapter(body))
        if c.source == "tokens":
            blocks = index.of_ids(c.ids or [], seed)
        else:
            blocks = index.of_text(data, c.text_tokens, seed)
        exact = None
        if c.tokens >= th and self.events is not None:
            exact, c = await self._exact(body, chat, c, tokenize, pools)
        dec, held, est = self._decoder(pools, blocks, exact)
        # vLLM recomputes at least the prompt's last token (kv_cache_manager.py, 0.31.0)
        matched = min(held, max(0, c.tokens - 1))
        reason, disagg = "above_threshold", True
        if c.tokens < th:
            reason, disagg = "below_threshold", False
        elif c.tokens - matched < th:
            reason, disagg = "prefix_cached", False
        elif self._prefill_busy(pools.prefillers) and (
            dec is None or dec.active < self.max_decoder_requests
        ):
            reason, disagg = "prefill_busy", False
        pre = self._prefiller(pools.prefillers, exact) if disagg and exact is not None else None
        return Decision(
            disagg, c.source, reason, c.tokens, c.exact, c.ids, dec, matched, blocks, est, pre
        )

    async def _goodput(
        self, body: dict[str, Any], chat: bool, tokenize: Tokenize, pools: Pools
    ) -> Decision:
        """``routing.decision: goodput`` (pd_router.plan). A text prompt is first weighed at
        its upper bound (bytes + template allowance): when no split could win even then, it is
        served whole without counting it (``bound``); otherwise it is counted exactly and each
        engine's share of it found, as the prefix decision finds the decoder's."""
        planner, costs, index = self.planner, self.costs, self.index
        assert planner is not None and costs is not None and index is not None
        now = costs.clock()
        out = requested_max_tokens(body, chat)
        out = out if type(out) is int else None
        seed, data = identity(body, chat, self._adapter(body))
        ids = None if chat else token_ids_prompt(body)
        if ids is not None:
            c = Count("tokens", len(ids), True, ids)
        else:
            text = prompt_text(body, chat)
            allowance = template_allowance(body, chat)
            raw = text.encode("utf-8", "surrogatepass")
            upper = len(raw) + allowance
            first = planner.choose(upper, _none, pools.decoders, pools.prefillers, out, now)
            if first is not None and first.reason == "handoff_not_worth":
                est = costs.estimate(len(raw)) + allowance
                blocks = index.of_text(data, max(0, est - allowance), seed)
                dec = first.option.decoder
                held, src = self._held(dec, blocks, None)
                matched = min(held, est - 1)
                opt = planner.retimed(
                    first.option, max(1, est - matched), costs.ttft_bound(est), now
                )
                held = {dec.base: matched}
                return Decision(
                    False, "bound", "handoff_not_worth", est, False, None, dec, matched, blocks,
                    src, None, opt, held, self._meter(est, held, out, body, opt),
                )  # fmt: skip
            c = await self._count_exactly(body, chat, text, raw, allowance, tokenize)
            if c.exact:
                costs.counted(len(raw), c.tokens - allowance)
        if c.source == "tokens":
            blocks = index.of_ids(c.ids or [], seed)
        else:
            blocks = index.of_text(data, c.text_tokens, seed)
        exact = None
        if self.events is not None:
            exact, c = await self._exact(body, chat, c, tokenize, pools)
        held: dict[str, int] = {}
        sources: dict[str, str] = {}
        for ep in (*pools.decoders, *pools.prefillers):
            if ep.base not in held:
                n, src = self._held(ep, blocks, exact)
                # vLLM recomputes at least the prompt's last token (kv_cache_manager.py, 0.31.0)
                held[ep.base], sources[ep.base] = min(n, max(0, c.tokens - 1)), src
        choice = planner.choose(
            c.tokens, lambda ep: held[ep.base], pools.decoders, pools.prefillers, out, now
        )
        if choice is None:  # no healthy decoder: the route answers that
            return Decision(False, c.source, "handoff_not_worth", c.tokens, c.exact, c.ids)
        o = choice.option
        dec = o.decoder
        return Decision(
            o.prefiller is not None, c.source, choice.reason, c.tokens, c.exact, c.ids, dec,
            held[dec.base], blocks, sources[dec.base], o.prefiller, o, held,
            self._meter(c.tokens, held, out, body, o),
        )  # fmt: skip

    def _adapter(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter ``body`` names, or None: an adapter's KV is its own (vLLM hashes
        its blocks with its name), so the prefix index keys it apart."""
        model = body.get("model")
        return model if model in self.adapters else None

    def _meter(
        self, tokens: int, held: dict[str, int], out: int | None, body: dict[str, Any], o: Option
    ) -> Meter:
        assert self.costs is not None
        budget = out if out and out > 0 else DEFAULT_OUTPUT_TOKENS
        slack = self.costs.ttft_bound(tokens) - o.ttft
        stream = body.get("stream") is True
        return Meter(self.costs, tokens, held, budget, stream, o.planned(), slack)

    async def _count_exactly(
        self,
        body: dict[str, Any],
        chat: bool,
        text: str,
        raw: bytes,
        allowance: int,
        tokenize: Tokenize,
    ) -> Count:
        """The prompt's exact size for the goodput decision: the local tokenizer (off the loop
        for long texts), else an engine's /tokenize, else bytes / 4."""
        counter = self.counter
        if counter.local is not None:
            if len(raw) <= INLINE_BYTES:
                n = counter.local_count(text, allowance)
            else:
                n = await counter.count(text, allowance)
            return Count("tokenizer", n, True, allowance=allowance)
        try:
            ids = await tokenize(body, chat)
        except TokenizeError:
            est = max(1, (len(raw) + allowance) // BYTES_PER_TOKEN)
            return Count("estimate", est, allowance=allowance)
        return Count("engine", len(ids), True, ids, allowance)

    async def _exact(
        self, body: dict[str, Any], chat: bool, c: Count, tokenize: Tokenize, pools: Pools
    ) -> tuple[Exact | None, Count]:
        """The prompt's ids when an engine's events could say what it holds (a long prompt, a
        reproducible identity, an engine with an exact, non-empty picture); the count becomes
        exact. Only here does a long prompt pay for the engine's /tokenize."""
        events = self.events
        assert events is not None
        pictures = [
            events.exact(ep.base, ep.generation) for ep in (*pools.decoders, *pools.prefillers)
        ]
        if not any(e is not None and e.blocks for e in pictures):
            if pictures and all(e is not None for e in pictures):
                return Exact([], Identity()), c  # every engine is known to hold nothing
            return None, c
        model = body.get("model")
        lora = None if model is None or model in self.base_names else model
        if isinstance(model, str) and any(model.startswith(n + "@") for n in self.base_names):
            lora = None  # the revision's name (pd_router.revision)
        ident = identity_of(body, chat, lora)
        if not ident.reproducible:
            return Exact([], ident), c
        ids = c.ids
        if ids is None:
            try:
                ids = await tokenize(body, chat)
            except TokenizeError:
                return None, c
            c = Count("engine", len(ids), True, ids, c.allowance)
        return Exact(ids, ident), c

    def _exact_hit(self, ep: Endpoint, exact: Exact | None) -> int | None:
        """Prompt tokens ``ep`` holds by its events; None when its picture is not exact."""
        if exact is None or self.events is None:
            return None
        e = self.events.exact(ep.base, ep.generation)
        if e is None:
            return None
        if not exact.ident.reproducible:
            return 0  # an identity the router cannot reproduce claims nothing
        return e.hit_tokens(exact.ids, exact.ident.extras)

    def _prefiller(self, prefillers: Sequence[Endpoint], exact: Exact) -> Endpoint | None:
        """The prefiller holding the longest prefix by its events (prefill-side reuse), unless
        it is ``maxLoadImbalance`` requests busier than the least busy; None: the balancer's."""
        best, best_n = None, 0
        for ep in prefillers:
            n = self._exact_hit(ep, exact) or 0
            if n > best_n or (n == best_n and best is not None and ep.active < best.active):
                best, best_n = ep, n
        if best is None or best.active > min(p.active for p in prefillers) + self.imbalance:
            return None
        return best

    def remember(self, ep: Endpoint, blocks: Blocks, known: Collection[Endpoint]) -> None:
        """``ep`` is sent the prompt; decoders no longer ``known`` (discovery) are forgotten."""
        index = self.index
        assert index is not None
        index.record(ep, blocks)
        index.forget_except(known)

    def _held(self, ep: Endpoint, blocks: Blocks, exact: Exact | None) -> tuple[int, str]:
        """Prompt tokens ``ep`` is taken to hold (whole blocks of its own) and from where: its
        KV events where its picture is exact, else the approximate index."""
        n = self._exact_hit(ep, exact)
        if n is not None:
            return n, "events"
        index = self.index
        assert index is not None
        return index.claimed(ep, blocks, index.matched(ep, blocks)), "approximate"

    def _decoder(
        self, pools: Pools, blocks: Blocks, exact: Exact | None
    ) -> tuple[Endpoint | None, int, str]:
        """The decoder holding the most of ``blocks`` (ties: the least busy), unless it is
        ``maxLoadImbalance`` requests busier than the least busy decoder; with a session
        affinity key, the session's decoder. Returns it, the prompt tokens it holds and where
        that figure comes from."""
        eps = pools.decoders
        if not eps:
            return None, 0, ""
        if pools.affinity:
            ep = balancing.pick(eps, balancing.decode_load, pools.affinity)
            assert ep is not None
            return ep, *self._held(ep, blocks, exact)
        best: Endpoint | None = None
        best_n, best_src = 0, ""
        for ep in eps:
            n, src = self._held(ep, blocks, exact)
            if n > best_n or (n == best_n and best is not None and ep.active < best.active):
                best, best_n, best_src = ep, n, src
        if best is None or best.active > min(e.active for e in eps) + self.imbalance:
            ep = balancing.pick(eps, balancing.decode_load)
            assert ep is not None
            return ep, *self._held(ep, blocks, exact)
        return best, best_n, best_src

    def _prefill_busy(self, prefillers: Sequence[Endpoint]) -> bool:
        """Every healthy prefiller has ``queuedTokens`` prompt tokens in flight or more (none
        healthy is not busy: the route falls back, ``no_prefiller``)."""
        lim = self.busy_tokens
        return lim > 0 and bool(prefillers) and all(p.queued_tokens >= lim for p in prefillers)

    async def _count(self, body: dict[str, Any], chat: bool, tokenize: Tokenize) -> Count:
        th = self.threshold
        ids = None if chat else token_ids_prompt(body)
        if ids is not None:
            return Count("tokens", len(ids), True, ids)
        text = prompt_text(body, chat)
        allowance = template_allowance(body, chat)
        data = text.encode("utf-8", "surrogatepass")
        nbytes = len(data) + allowance
        if nbytes < th:  # a token covers at least one byte: cannot reach the threshold
            return Count("bound", max(1, nbytes // BYTES_PER_TOKEN), allowance=allowance)
        counter = self.counter
        if counter.local is not None:
            if nbytes <= INLINE_BYTES:
                n = counter.local_count(text, allowance)
                return Count("tokenizer", n, True, allowance=allowance)
            n, exact = await counter.size(text, nbytes - allowance, allowance, th)
            return Count("tokenizer" if exact else "sampled", n, exact, allowance=allowance)
        try:
            ids = await tokenize(body, chat)
        except TokenizeError:
            return Count("estimate", max(1, nbytes // BYTES_PER_TOKEN), allowance=allowance)
        return Count("engine", len(ids), True, ids, allowance)


def _none(ep: Endpoint) -> int:
    return 0
