"""Which decoder probably holds a prompt's prefix in its vLLM prefix cache, and how much of it,
for engines whose KV-cache events the router does not hear (pd_router.kv_events is exact where
it does).

An approximate index, like llm-d's approximate prefix-cache scorer and vllm-router's
cache-aware policy: per decoder, the chained hashes of the prompt blocks this router process
sent there, in a bounded LRU (``routing.prefixCache.capacityTokens`` per decoder, or less when
the decoder says its cache holds less). Nothing is learnt from the engines but their cache's
shape (pd_router.cache_info), so it is right as long as the router's picture of what a decoder
was sent is: a decoder's own evictions, the answers it generated and cached, requests from
other router replicas or worker processes are unknown to it (docs/router.md, "Decode-first
decision").
A decoder that became healthy again (it may have restarted) starts with an empty picture.

What the engine's prompt starts with (:func:`identity`): vLLM renders the chat template over
the whole request, and real templates (Qwen's, Llama 3.x's) put the tools, and in Qwen's the
system prompt, before the first message; vLLM also makes ``cache_salt`` part of the first
block's identity (``v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``, 0.31.0),
and so of every block chained to it. So the chain of hashes starts from a seed covering what
changes every block (the chat template, its arguments, the salt), then runs over the tools,
functions and documents (as JSON), then over each message's role, name, content (text, and the
JSON of every other part: an image is part of the prompt's identity too), tool calls and tool
call id, in order. Agents with different tools share no block past where the tools differ;
two turns of one chat share what they share.
Left out: the template's own text between messages (the same for every request of a model),
and what a template does with a field the router does not name; the seed may miss a prefix
the engine would reuse (a Qwen system prompt before differing tools), never the other way.

Blocks as vLLM 0.31.0 hashes them (``hash_block_tokens``): only full blocks, each hash chaining
its parent's, so a hit on block ``i`` stands for the whole prefix up to it. A text prompt, whose
ids the router rarely knows, is cut into TEXT_BLOCK_BYTES of that identity stream (a 32 KB
prompt is 125 blocks to hash: measured 60 us), a token-id prompt into ID_BLOCK_TOKENS ids. Each
block weighs the tokens it stands for: the prompt's tokens but the template's allowance,
spread over the stream's bytes (roles and separators included, so a block is weighed low
rather than high). What a decoder is said to hold is then rounded DOWN to the decoder's own
prefix-match unit (its KV block: 16 tokens on GPUs by default, 128 on the CPU build, hundreds
for hybrid models), and a decoder that did not say claims nothing:
over-claiming sends a prompt the decoder must prefill itself (the stall disaggregation exists
to avoid), under-claiming only costs a prefill the prefiller would have done anyway.
A block is recorded most recent last-to-first, as vLLM frees a request's blocks in reverse
(``v1/core/single_type_kv_cache_manager.py`` ``free``), so a prefix's tail is evicted before
its head and the leading-run lookup below stays exact under eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from pd_router.discovery import Endpoint

BYTES_PER_TOKEN = 4  # the usual BPE figure for English text and code (also decide's estimate)
TEXT_BLOCK_BYTES = 256
ID_BLOCK_TOKENS = 16  # the router's unit for token-id prompts (finer than any engine's block)
# Request fields that change every block of the prompt when they change (chat only but salt).
SEED_FIELDS = ("chat_template", "chat_template_kwargs")
# Rendered before the first message (tools: Qwen's and Llama 3.x's templates): the stream's head.
HEAD_FIELDS = ("tools", "functions", "documents")
_RS, _US = b"\x1e", b"\x1f"  # separators that never occur in JSON or in the fields' own text


@dataclass(frozen=True, slots=True)
class Blocks:
    """A prompt's full-block hashes and how many prompt tokens one block stands for."""

    hashes: list[int]
    tokens_per_block: float

    def tokens(self, n_blocks: int) -> int:
        return int(n_blocks * self.tokens_per_block)


def block_hashes(chunks: Sequence[bytes | tuple[int, ...]], seed: int = 0) -> list[int]:
    out: list[int] = []
    h = seed
    for c in chunks:
        h = hash((h, c))
        out.append(h)
    return out


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def identity(body: dict[str, Any], chat: bool, adapter: str | None = None) -> tuple[int, bytes]:
    """(seed, stream): what the engine's prompt starts with and then holds, as far as the
    router can tell without rendering the template (module docstring); ``adapter``: the LoRA
    adapter it is for (None: the base model), whose blocks are its own."""
    seed = 0
    salt = body.get("cache_salt")
    keys: list[bytes] = [_bytes(salt)] if salt is not None else []
    if adapter is not None:
        keys.append(b"lora" + _US + adapter.encode())
    if not chat:
        p = body.get("prompt")
        text = p if isinstance(p, str) else "\n".join(x for x in p or () if isinstance(x, str))
        if keys:
            seed = hash(tuple(keys))
        return seed, text.encode("utf-8", "surrogatepass")
    for f in SEED_FIELDS:
        v = body.get(f)
        if v is not None:
            keys.append(f.encode() + _US + _bytes(v))
    if keys:
        seed = hash(tuple(keys))
    parts: list[bytes] = []
    for f in HEAD_FIELDS:
        v = body.get(f)
        if v is not None:
            parts.append(f.encode() + _US + _bytes(v) + _RS)
    for m in body["messages"]:
        if not isinstance(m, dict):
            continue
        parts.append(_bytes(m.get("role", "")))
        if m.get("name") is not None:
            parts.append(_US + _bytes(m["name"]))
        parts.append(_US)
        c = m.get("content")
        if isinstance(c, str):
            parts.append(_bytes(c))
        elif isinstance(c, list):
            for p in c:
                text = p.get("text") if isinstance(p, dict) else None
                parts.append(_bytes(text) if isinstance(text, str) else _bytes(p))
        elif c is not None:
            parts.append(_bytes(c))
        for f in ("tool_calls", "tool_call_id", "function_call"):
            if m.get(f) is not None:
                parts.append(_US + f.encode() + _US + _bytes(m[f]))
        parts.append(_RS)
    return seed, b"".join(parts)


class _Held(OrderedDict[int, int]):
    """One decoder's blocks, least recently sent first, each with the tokens it stands for."""

    tokens = 0
    generation = 0  # the decoder's healthy generation this picture is of


class PrefixIndex:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._held: dict[str, _Held] = {}

    @staticmethod
    def of_text(data: bytes, n_tokens: int, seed: int = 0) -> Blocks:
        """The blocks of a text prompt's identity stream; ``n_tokens``: its (estimated) length."""
        bb = TEXT_BLOCK_BYTES
        n = len(data) // bb
        hashes = block_hashes([data[i * bb : (i + 1) * bb] for i in range(n)], seed)
        per = n_tokens * bb / len(data) if data else 0.0
        return Blocks(hashes, per)

    @staticmethod
    def of_ids(ids: Sequence[int], seed: int = 0) -> Blocks:
        bt = ID_BLOCK_TOKENS
        n = len(ids) // bt
        return Blocks(block_hashes([tuple(ids[i * bt : (i + 1) * bt]) for i in range(n)], seed), bt)

    def _picture(self, ep: Endpoint) -> _Held | None:
        held = self._held.get(ep.base)
        return held if held is not None and held.generation == ep.generation else None

    def matched(self, ep: Endpoint, blocks: Blocks) -> int:
        """How many leading blocks of the prompt ``ep`` was sent (in its current generation)."""
        held = self._picture(ep)
        if not held:
            return 0
        n = 0
        for h in blocks.hashes:
            if h not in held:
                break
            n += 1
        return n

    @staticmethod
    def claimed(ep: Endpoint, blocks: Blocks, n_blocks: int) -> int:
        """The prompt tokens ``ep`` is taken to hold for ``n_blocks`` matched blocks: rounded
        down to its prefix-match unit; none when it did not say, caches nothing, or is hybrid."""
        info = ep.cache
        if info is None or not info.prefix_caching or info.hybrid:
            return 0  # unknown, nothing cached, or unknowable (cache_info: hybrid)
        tokens = blocks.tokens(n_blocks)
        return tokens - tokens % info.match_unit

    def record(self, ep: Endpoint, blocks: Blocks) -> None:
        """``ep`` is sent the prompt: its blocks become its most recent, the head last."""
        held = self._picture(ep)
        if held is None:
            held = self._held[ep.base] = _Held()
            held.generation = ep.generation
        weight = max(1, round(blocks.tokens_per_block))
        for h in reversed(blocks.hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = weight
                held.tokens += weight
        cap = self.capacity_tokens
        if ep.cache is not None and ep.cache.capacity_tokens:
            cap = min(cap, ep.cache.capacity_tokens)
        while held.tokens > cap:
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
        held = self._picture(ep)
        return (len(held), held.tokens) if held else (0, 0)
