"""Which decoder probably holds a prompt's prefix in its vLLM prefix cache.

An approximate index, like llm-d's approximate prefix-cache scorer and vllm-router's
cache-aware policy: per decoder, the chained hashes of the prompt blocks this router process
sent there, in a bounded LRU (``routing.prefixCache.capacityTokens`` per decoder). Nothing is
learnt from the engines, so it is right as long as the router's picture of what a decoder was
sent is: a decoder's own evictions, restarts and requests from other router replicas or worker
processes are unknown to it (README, "Decode-first decision").

Blocks as vLLM 0.31.0 hashes them (``v1/core/kv_cache_utils.py`` ``hash_block_tokens``): only
full blocks, each hash chaining its parent's, so a hit on block ``i`` stands for the whole
prefix up to it. A token-id prompt is cut into ``blockTokens`` ids; a text prompt, whose ids the
router rarely knows, into TEXT_BLOCK_BYTES of its UTF-8 text (about four vLLM blocks: a 32 KB
prompt is 125 blocks to hash, not 500, measured 245 -> 60 us; a match is then known to within
64 tokens, far below any useful threshold). Each block weighs the tokens it stands for, and a
decoder's blocks are evicted once they weigh more than ``capacityTokens``. A block is
recorded most recent last-to-first, as vLLM frees a request's blocks in reverse
(``v1/core/single_type_kv_cache_manager.py`` ``free``), so a prefix's tail is evicted before its
head and the leading-run lookup below stays exact under eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pd_router.discovery import Endpoint

BYTES_PER_TOKEN = 4  # the usual BPE figure for English text and code (also decide's estimate)
TEXT_BLOCK_BYTES = 256


@dataclass(frozen=True, slots=True)
class Blocks:
    """A prompt's full-block hashes and how many prompt tokens one block stands for."""

    hashes: list[int]
    tokens_per_block: float

    def tokens(self, n_blocks: int) -> int:
        return int(n_blocks * self.tokens_per_block)


def block_hashes(chunks: Sequence[bytes | tuple[int, ...]]) -> list[int]:
    out: list[int] = []
    h = 0
    for c in chunks:
        h = hash((h, c))
        out.append(h)
    return out


class _Held(OrderedDict[int, int]):
    """One decoder's blocks, least recently sent first, each with the tokens it stands for."""

    tokens = 0


class PrefixIndex:
    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_tokens = capacity_tokens
        self._held: dict[str, _Held] = {}

    def of_text(self, data: bytes, n_tokens: int) -> Blocks:
        """The blocks of a text prompt's UTF-8 bytes; ``n_tokens``: its (estimated) length."""
        bb = TEXT_BLOCK_BYTES
        n = len(data) // bb
        hashes = block_hashes([data[i * bb : (i + 1) * bb] for i in range(n)])
        per = n_tokens * bb / len(data) if data else 0.0
        return Blocks(hashes, per)

    def of_ids(self, ids: Sequence[int]) -> Blocks:
        bt = self.block_tokens
        n = len(ids) // bt
        return Blocks(block_hashes([tuple(ids[i * bt : (i + 1) * bt]) for i in range(n)]), bt)

    def matched(self, ep: Endpoint, blocks: Blocks) -> int:
        """How many leading blocks of the prompt ``ep`` holds."""
        held = self._held.get(ep.base)
        if not held:
            return 0
        n = 0
        for h in blocks.hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, ep: Endpoint, blocks: Blocks) -> None:
        """``ep`` is sent the prompt: its blocks become its most recent, the head last."""
        held = self._held.get(ep.base)
        if held is None:
            held = self._held[ep.base] = _Held()
        weight = max(1, round(blocks.tokens_per_block))
        for h in reversed(blocks.hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = weight
                held.tokens += weight
        while held.tokens > self.capacity_tokens:
            held.tokens -= held.popitem(last=False)[1]

    def forget_except(self, live: Collection[Endpoint]) -> None:
        """Drop the index of decoders that left the pool (their pods' caches went with them);
        checked only once more decoders are indexed than are known, so at most one more."""
        if len(self._held) <= len(live):
            return
        keep = {e.base for e in live}
        for base in [b for b in self._held if b not in keep]:
            del self._held[base]

    def size(self, ep: Endpoint) -> tuple[int, int]:
        """(blocks, tokens they stand for) held for ``ep``; the tokens never above capacity."""
        held = self._held.get(ep.base)
        return (len(held), held.tokens) if held else (0, 0)
