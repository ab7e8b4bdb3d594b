"""Deterministic toy "model" of the simulated engine: tokenizer, chat template and generation.

Generation is autoregressive over a rolling hash of the whole token sequence, so an engine
that receives ``prompt + [first_tok]`` continues exactly where a single engine would have:
the disaggregated answer equals the direct answer token for token.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

BOS = 1
USER = 2
ASSISTANT = 3
SYSTEM = 4
END = 5
EOS = 6
TOOL = 7
ROLE_TOKENS = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM, "tool": TOOL}
ROLE_TOKENS["developer"] = SYSTEM

PROMPT_VOCAB = 32000
OUT_BASE = 100
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "are",
    "which",
    "or",
    "his",
    "her",
    "have",
    "had",
    "not",
    "but",
    "were",
    "they",
    "one",
    "all",
    "their",
    "has",
    "been",
    "more",
    "when",
    "there",
    "can",
    "who",
    "some",
    "time",
    "out",
    "other",
    "into",
    "only",
    "new",
    "also",
    "would",
    "what",
    "up",
    "about",
    "so",
    "these",
    "its",
    "first",
    "may",
    "two",
    "over",
    "after",
    "any",
    "most",
    "where",
    "well",
    "between",
    "through",
    "long",
    "then",
    "many",
    "very",
    "made",
    "must",
    "back",
    "state",
    "such",
    "city",
    "tokens",
    "prefill",
    "decode",
    "cache",
    "router",
    "stream",
    "engine",
    "model",
    "answer",
    "quickly",
    "bright",
    "river",
    "stone",
    "cloud",
    "paper",
    "garden",
    "window",
    "silver",
    "orange",
    "planet",
    "signal",
    "harbor",
    "market",
    "winter",
    "summer",
    "forest",
]
VOCAB_OUT = [w + " " for w in _WORDS]
_WORD_RE = re.compile(r"\w+|[^\w\s]")
_MASK = (1 << 64) - 1


def tokenize_text(text: str, add_bos: bool = True) -> list[int]:
    ids = [
        OUT_BASE + len(VOCAB_OUT) + zlib.crc32(w.encode()) % PROMPT_VOCAB
        for w in _WORD_RE.findall(text)
    ]
    return [BOS, *ids] if add_bos else ids


def message_text(content: Any) -> str:
    """Text of a chat message content (string or list of {type: text, text} parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError("content parts must be objects")
            if part.get("type") == "text":
                t = part.get("text")
                if not isinstance(t, str):
                    raise ValueError("text part needs a string 'text'")
                parts.append(t)
        return " ".join(parts)
    raise ValueError("message content must be a string, a list of parts or null")


def apply_chat_template(messages: Any, add_generation_prompt: bool = True) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    ids = [BOS]
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        ids.append(ROLE_TOKENS.get(m["role"], SYSTEM))
        ids.extend(tokenize_text(message_text(m.get("content")), add_bos=False))
        ids.append(END)
    if add_generation_prompt:
        ids.append(ASSISTANT)
    return ids


def _mix(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK
    return h ^ (h >> 33)


def seq_hash(tokens: list[int], h: int = 1469598103934665603) -> int:
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) & _MASK
    return h


def next_token(h: int, ignore_eos: bool) -> int:
    m = _mix(h)
    if not ignore_eos and m % 64 == 0:
        return EOS
    return OUT_BASE + (m >> 8) % len(VOCAB_OUT)


# token ids below this are the model's (vLLM refuses a prompt holding another): Llama-3's
# vocabulary, the simulated model's (its config.json ``vocab_size``), which holds the special
# and output tokens and the prompt words' ids
VOCAB_SIZE = 128256
assert OUT_BASE + len(VOCAB_OUT) + PROMPT_VOCAB <= VOCAB_SIZE


def top_logprobs(state: int, tok: int, k: int) -> list[tuple[int, float]]:
    """The sampled token ``tok`` with its log-probability, then the next likeliest tokens, ``k``
    in all at least one (what vLLM's Logprob dicts hold), decreasing, all below 0. Drawn from
    the sequence's state before ``tok`` (``Generator.h``), so one prompt on one set of weights
    gets the same figures on every engine, and other weights other ones. The sampled token
    is the likeliest (the simulator samples greedily)."""
    lp = -0.05 - (_mix(state ^ 0x5851F42D4C957F2D) & 0xFFFF) / 0xFFFF * 4.0
    out = [(tok, lp)]
    seen = {tok}
    salt = 0
    while len(out) < k and salt < 4 * k:
        salt += 1
        m = _mix(state + 0x9E37 * salt)
        alt = OUT_BASE + (m >> 8) % len(VOCAB_OUT)
        if alt in seen:
            continue
        seen.add(alt)
        lp -= 0.01 + (m & 0xFFFF) / 0xFFFF
        out.append((alt, lp))
    return out


def token_text(tok: int) -> str:
    if OUT_BASE <= tok < OUT_BASE + len(VOCAB_OUT):
        return VOCAB_OUT[tok - OUT_BASE]
    if tok == EOS:
        return ""
    return f"<{tok}>"


class Generator:
    """Yields successive greedy tokens for a prompt (one per call).

    ``index`` is the choice of an ``n > 1`` request: choice 0 is the plain answer (so the
    disaggregated continuation property holds for it), the others start from a seed derived
    from the index, so the n choices differ and are reproducible."""

    __slots__ = ("h", "ignore_eos")

    def __init__(
        self, prompt: list[int], ignore_eos: bool, index: int = 0, weights: int = 0
    ) -> None:
        h = seq_hash(prompt)
        if weights:  # other weights (--weights-seed): other answers to every prompt
            h = _mix(h ^ ((weights * 0xC2B2AE3D27D4EB4F) & _MASK))
        self.h = _mix(h ^ ((index * 0x9E3779B97F4A7C15) & _MASK)) if index else h
        self.ignore_eos = ignore_eos

    def step(self, suppress_eos: bool = False, banned: frozenset[int] = frozenset()) -> int:
        """``suppress_eos``: vLLM's ``min_tokens`` not reached yet; ``banned``: the
        request's ``stop_token_ids`` then, which vLLM masks too (v1/sample/logits_processor/
        builtin.py, 0.31: MinTokensLogitsProcessor masks ``all_stop_token_ids``)."""
        tok = next_token(self.h, self.ignore_eos or suppress_eos)
        salt = 0
        while tok in banned and salt < 64:
            salt += 1
            tok = OUT_BASE + (_mix(self.h + salt) >> 8) % len(VOCAB_OUT)
        self.h = seq_hash([tok], self.h)
        return tok


class TextState:
    """Output text of one sequence with vLLM's stop-string rules (v1/engine/detokenizer.py,
    0.31, ``BaseIncrementalDetokenizer`` and ``check_stop_strings``): a stop string ends the
    sequence and, unless ``include_stop_str_in_output``, is cut from the text together with
    anything after it; a token that stopped the sequence (EOS or a stop token id) adds no
    text then either; stop strings are looked for only after ``min_tokens`` tokens, and in
    the text those tokens produced not at all. Streamed text holds back the last
    ``len(longest stop string) - 1`` characters until the sequence ends, so a stop string
    never leaks out half-seen."""

    __slots__ = ("hold", "include", "min_tokens", "n", "sent", "stop", "text")

    def __init__(self, stop: list[str], include: bool, min_tokens: int) -> None:
        self.stop = stop
        self.include = include
        self.min_tokens = min_tokens
        self.hold = max(len(s) for s in stop) - 1 if stop and not include else 0
        self.text = ""
        self.sent = 0
        self.n = 0

    def add(self, tok: int, stop_terminated: bool) -> str | None:
        """One output token; the stop string it completed, if any."""
        self.n += 1
        start = len(self.text)
        if self.include or not stop_terminated:
            # appended to a local that holds the only reference: CPython grows the string
            # in place, so a long answer is not copied once per token
            text, self.text = self.text, ""
            text += token_text(tok)
            self.text = text
        if self.min_tokens and self.n <= self.min_tokens:
            start = len(self.text)
        new = len(self.text) - start
        if not self.stop or self.n <= self.min_tokens or not new:
            return None
        best: tuple[str, int, int] | None = None
        for s in self.stop:
            # only where the new text can complete it; the earliest completion wins
            i = self.text.find(s, max(0, len(self.text) - new - len(s) + 1))
            if i != -1 and (best is None or i + len(s) < best[2]):
                best = (s, i, i + len(s))
        if best is None:
            return None
        s, i, end = best
        self.text = self.text[:end] if self.include else self.text[:i]
        return s

    def delta(self, finished: bool) -> str:
        """Text not handed out yet (all of it once ``finished``)."""
        upto = len(self.text) - (0 if finished else self.hold)
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out
