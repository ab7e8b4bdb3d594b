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


def token_text(tok: int) -> str:
    if OUT_BASE <= tok < OUT_BASE + len(VOCAB_OUT):
        return VOCAB_OUT[tok - OUT_BASE]
    if tok == EOS:
        return ""
    return f"<{tok}>"


class Generator:
    """Yields successive greedy tokens for a prompt (one per call)."""

    __slots__ = ("h", "ignore_eos")

    def __init__(self, prompt: list[int], ignore_eos: bool) -> None:
        self.h = seq_hash(prompt)
        self.ignore_eos = ignore_eos

    def step(self, suppress_eos: bool = False) -> int:
        """``suppress_eos``: vLLM's ``min_tokens`` not reached yet."""
        tok = next_token(self.h, self.ignore_eos or suppress_eos)
        self.h = seq_hash([tok], self.h)
        return tok
