"""Prompt token counting for the routing decision (no I/O; the ladder is pd_router.decide).

Order (cheapest exact-enough first):
1. ``threshold == 0``: nothing to count (every request is disaggregated).
2. ``prompt`` given as token ids: its length.
3. A proven upper bound below the threshold: a BPE token covers at least one UTF-8 byte, so
   ``bytes(text) + template allowance`` bounds the count; below the threshold means direct
   without tokenizing at all (most short chat turns never pay for tokenization).
4. Local ``tokenizers`` tokenizer, plus the chat-template allowance: a file
   (``model.tokenizer``) or fetched once at start-up from a hub (``model.tokenizerHub``,
   pd_router.hub_tokenizer). Counting must not stall the event loop (an 8,000-token prompt
   takes ~14 ms to encode, and ``Tokenizer.encode`` holds the GIL): a short text is encoded
   inline; a longer one is first *sampled* (windows encoded, tokens per byte extrapolated):
   the middle window alone decides beyond ``FIRST_WINDOW_MARGIN`` of the threshold, all
   three beyond ``SAMPLE_MARGIN``; only a prompt near the threshold is counted exactly. Both
   run in a thread (``encode_batch`` releases the GIL, measured with tokenizers 0.23.3), so the
   loop never waits for the tokenizer.
5. The engine's ``POST /tokenize`` (applies the real chat template; the ids are reused as the
   LMCache prefill prompt): ``pd_router.legs.Legs.tokenize``.
6. Estimate (bytes / 4) when nothing else answered; counted in ``pd_router_token_count``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from pathlib import Path
from typing import Any

import orjson

from pd_router.config import ConfigError

log = logging.getLogger("pd_router.tokens")

# Texts up to this many UTF-8 bytes are encoded whole on the event loop (well under 1 ms).
INLINE_BYTES = 2048
SAMPLE_WINDOWS = 3  # characters taken at the start, the middle and the end
SAMPLE_CHARS = 512
# A sampled estimate decides only beyond this factor of the threshold (tokens per byte varies
# along a prompt: prose, code, tables); nearer, the count is exact.
SAMPLE_MARGIN = 1.5
# The middle window alone decides beyond this wider factor (a prompt many times the threshold,
# the usual long prompt, costs one window's encoding: make bench, "The decision's cost").
FIRST_WINDOW_MARGIN = 3.0
TEMPLATE_BASE = 64  # allowance for chat-template tokens (system header, generation prompt)
TEMPLATE_PER_MESSAGE = 8


def decided(estimate: int, threshold: int, margin: float) -> bool:
    """An estimate decides when it is ``margin`` times beyond the threshold, either way."""
    return estimate >= threshold * margin or estimate * margin <= threshold


def tools_json(body: dict[str, Any]) -> str:
    """The tools (and legacy functions) a chat template renders, as JSON; "" when none."""
    out = [
        orjson.dumps(body[k]).decode() for k in ("tools", "functions") if body.get(k) is not None
    ]
    return "\n".join(out)


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """What a prompt's tokens are made of, but the chat template's own: the text of every
    message and, for a chat, the JSON of its tools (templates render them, as text)."""
    if chat:
        parts: list[str] = []
        tools = tools_json(body)
        if tools:
            parts.append(tools)
        for m in body["messages"]:
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                for p in c:
                    if isinstance(p, dict) and isinstance(p.get("text"), str):
                        parts.append(p["text"])
        return "\n".join(parts)
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list):
        return "\n".join(x for x in p if isinstance(x, str))
    return ""


def template_allowance(body: dict[str, Any], chat: bool) -> int:
    """Tokens a chat template adds around the text (system header, role markers, generation
    prompt), an upper bound: the count decides a threshold, where too many only disaggregates."""
    if not chat:
        return 4
    return TEMPLATE_BASE + TEMPLATE_PER_MESSAGE * len(body["messages"])


def token_ids_prompt(body: dict[str, Any]) -> list[int] | None:
    p = body.get("prompt")
    if isinstance(p, list) and p and all(type(t) is int for t in p):
        return p
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
        inner = p[0]
        if inner and all(type(t) is int for t in inner):
            return inner
    return None


def load_local_tokenizer(spec: str) -> Any:
    """Load ``tokenizer.json`` from a file path or a directory containing it (at start-up;
    a path that does not hold a loadable tokenizer is a :class:`ConfigError` naming
    ``model.tokenizer``)."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for every failure
        msg = f"model.tokenizer: cannot load a tokenizer from {str(path)!r}: {exc}"
        raise ConfigError(msg) from None


def tokenizer_from_json(text: str, where: str) -> Any:
    """Parse a fetched ``tokenizer.json`` (ConfigError naming ``model.tokenizerHub``)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for every failure
        msg = f"model.tokenizerHub: {where} is not a loadable tokenizer.json: {exc}"
        raise ConfigError(msg) from None


class TokenCounter:
    def __init__(self, tokenizer_spec: str, served_name: str) -> None:
        self.served_name = served_name
        self.local = load_local_tokenizer(tokenizer_spec) if tokenizer_spec else None
        self.source = "file" if self.local is not None else "none"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def use(self, tokenizer: Any, source: str) -> None:
        """Install a tokenizer obtained after construction (the hub fetch at start-up)."""
        self.local = tokenizer
        self.source = source

    def local_count(self, text: str, allowance: int) -> int:
        """Exact, on the calling thread (short texts: see INLINE_BYTES)."""
        assert self.local is not None
        # len(Encoding) counts without building the ids list (tokenizers 0.23.3)
        return len(self.local.encode(text, add_special_tokens=False)) + allowance

    def sampled(self, text: str, nbytes: int, allowance: int, threshold: int = 0) -> int:
        """Estimated tokens of ``text`` (``nbytes`` long) from encoded windows: the middle one
        first, returned alone when it is ``FIRST_WINDOW_MARGIN`` beyond ``threshold`` (0: never),
        else the start, middle and end together."""
        assert self.local is not None
        n = len(text)
        step = max(1, (n - SAMPLE_CHARS) // max(1, SAMPLE_WINDOWS - 1))
        windows = [text[i : i + SAMPLE_CHARS] for i in range(0, n, step)][:SAMPLE_WINDOWS]
        middle = windows.pop(len(windows) // 2)
        tokens, sampled_bytes = self._encoded([middle])
        est = round(nbytes * tokens / max(1, sampled_bytes)) + allowance
        if not windows or (threshold and decided(est, threshold, FIRST_WINDOW_MARGIN)):
            return est
        more_tokens, more_bytes = self._encoded(windows)
        tokens, sampled_bytes = tokens + more_tokens, sampled_bytes + more_bytes
        return round(nbytes * tokens / max(1, sampled_bytes)) + allowance

    def _encoded(self, windows: list[str]) -> tuple[int, int]:
        """(tokens, UTF-8 bytes) of ``windows``; ``encode_batch`` releases the GIL."""
        assert self.local is not None
        enc = self.local.encode_batch(windows, add_special_tokens=False)
        nbytes = sum(len(w.encode("utf-8", "surrogatepass")) for w in windows)
        return sum(len(e) for e in enc), nbytes

    def exact(self, text: str, allowance: int) -> int:
        """Exact, on the calling thread with the GIL released (``encode_batch``); the length is
        taken here too, so the Encoding's ids list is never built on the loop (measured: the
        loop thread's CPU per 8,000-token count 1.1 -> 0.4 ms)."""
        assert self.local is not None
        return len(self.local.encode_batch([text], add_special_tokens=False)[0]) + allowance

    def sized(self, text: str, nbytes: int, allowance: int, threshold: int) -> tuple[int, bool]:
        """(tokens, exact): the sampled estimate when it decides against ``threshold`` (beyond
        ``SAMPLE_MARGIN``), else the exact count."""
        est = self.sampled(text, nbytes, allowance, threshold)
        if decided(est, threshold, SAMPLE_MARGIN):
            return est, False
        return self.exact(text, allowance), True

    async def size(
        self, text: str, nbytes: int, allowance: int, threshold: int
    ) -> tuple[int, bool]:
        """:meth:`sized` in the counting thread, one hop for the sample and the exact count
        (sampling on the loop blocked it 0.7 ms; two hops cost the loop 0.2 ms more than one:
        make bench, "The decision's cost")."""
        return await asyncio.get_running_loop().run_in_executor(
            self._threads(), self.sized, text, nbytes, allowance, threshold
        )

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pd-count")
        return self._pool

    async def count(self, text: str, allowance: int) -> int:
        """:meth:`exact`, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._threads(), self.exact, text, allowance
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
