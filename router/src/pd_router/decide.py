"""The routing decision: is this request disaggregated (prefill, then decode) or served by one
decoder? Pure but for the injected ``tokenize`` (an engine's /tokenize), so it is unit-tested
without processes.

The counting ladder, cheapest exact-enough first (pd_router.tokens explains each bound):
``n > 1`` or a batched prompt -> direct (``skipped``; the hand-offs carry one sequence);
threshold 0 -> disaggregated without counting (``skipped``); token-id prompt -> its length
(``tokens``); UTF-8 bytes + template allowance below the threshold -> direct (``bound``); the
local tokenizer: a sampled estimate far enough from the threshold
(``sampled``), else the exact count, off the event loop for long texts (``tokenizer``); the
engine's /tokenize (``engine``; its ids are reused by the
LMCache prefill leg); bytes / 4 when nothing answered (``estimate``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pd_router.failures import TokenizeError
from pd_router.openai_wire import is_batch
from pd_router.tokens import (
    INLINE_BYTES,
    SAMPLE_MARGIN,
    TokenCounter,
    prompt_text,
    template_allowance,
    token_ids_prompt,
)

Tokenize = Callable[[dict[str, Any], bool], Awaitable[list[int]]]


@dataclass(frozen=True, slots=True)
class Decision:
    disaggregate: bool
    source: str  # pd_router_token_count_source_total label
    tokens: int | None = None  # the prompt size observed (exact or estimated); None: uncounted
    exact: bool = False  # ``tokens`` is the exact prompt length
    ids: list[int] | None = None  # the prompt's token ids, when they were learnt


class Decider:
    def __init__(self, threshold: int, counter: TokenCounter) -> None:
        self.threshold = threshold
        self.counter = counter

    async def decide(self, body: dict[str, Any], chat: bool, tokenize: Tokenize) -> Decision:
        """``tokenize(body, chat)``: the exact ids from an engine, or TokenizeError."""
        th = self.threshold
        if is_batch(body, chat):
            return Decision(False, "skipped")
        if th == 0:
            return Decision(True, "skipped")
        ids = None if chat else token_ids_prompt(body)
        if ids is not None:
            return Decision(len(ids) >= th, "tokens", len(ids), True, ids)
        text = prompt_text(body, chat)
        allowance = template_allowance(body, chat)
        nbytes = len(text.encode("utf-8", "surrogatepass")) + allowance
        if nbytes < th:  # a token covers at least one byte: cannot reach the threshold
            return Decision(False, "bound", max(1, nbytes // 4))
        counter = self.counter
        if counter.local is not None:
            if nbytes <= INLINE_BYTES:
                n = counter.local_count(text, allowance)
                return Decision(n >= th, "tokenizer", n, True)
            est = counter.sampled(text, nbytes - allowance, allowance)
            if est >= th * SAMPLE_MARGIN or est * SAMPLE_MARGIN <= th:
                return Decision(est >= th, "sampled", est)
            n = await counter.count(text, allowance)
            return Decision(n >= th, "tokenizer", n, True)
        try:
            ids = await tokenize(body, chat)
        except TokenizeError:
            est = max(1, nbytes // 4)
            return Decision(est >= th, "estimate", est)
        return Decision(len(ids) >= th, "engine", len(ids), True, ids)
