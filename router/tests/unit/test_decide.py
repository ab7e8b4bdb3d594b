"""The routing decision without I/O: every rung of the counting ladder, and when /tokenize is
(and is not) asked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pd_router.decide import Decider, Decision
from pd_router.failures import TokenizeError


class Counter:
    def __init__(self, per_char: float | None) -> None:
        self.local = object() if per_char is not None else None
        self.per_char = per_char

    def local_count(self, text: str, allowance: int) -> int:
        assert self.per_char is not None
        return int(len(text) * self.per_char) + allowance


def decide(
    body: dict[str, Any],
    chat: bool = False,
    threshold: int = 100,
    per_char=None,
    engine: Any = None,
) -> tuple[Decision, int]:
    asked = 0

    async def tokenize(b: dict[str, Any], c: bool) -> list[int]:
        nonlocal asked
        asked += 1
        if isinstance(engine, Exception):
            raise engine
        return list(range(engine))

    d = asyncio.run(Decider(threshold, Counter(per_char)).decide(body, chat, tokenize))  # type: ignore[arg-type]
    return d, asked


@pytest.mark.parametrize(
    "body",
    [{"prompt": "x" * 1000, "n": 2}, {"prompt": ["a" * 500, "b" * 500]}, {"prompt": [[1, 2], [3]]}],
)
def test_batches_and_n_above_one_go_direct_uncounted(body: dict[str, Any]) -> None:
    d, asked = decide(body, engine=10_000)
    assert d == Decision(False, "skipped") and asked == 0


def test_threshold_zero_disaggregates_without_counting() -> None:
    d, asked = decide({"prompt": "hi"}, threshold=0, engine=5)
    assert d == Decision(True, "skipped") and asked == 0


@pytest.mark.parametrize(("n", "split"), [(99, False), (100, True)])
def test_token_id_prompts_count_exactly(n: int, split: bool) -> None:
    ids = list(range(n))
    for prompt in (ids, [ids]):
        d, asked = decide({"prompt": prompt}, engine=1)
        assert (d.disaggregate, d.source, d.tokens, d.exact, d.ids) == (
            split,
            "tokens",
            n,
            True,
            ids,
        )
        assert asked == 0


def test_a_byte_bound_below_the_threshold_never_tokenizes() -> None:
    # 50 bytes + the completions allowance (4) < 100: no BPE token is smaller than a byte
    d, asked = decide({"prompt": "x" * 50}, engine=10_000)
    assert (d.disaggregate, d.source, asked) == (False, "bound", 0)
    d, _ = decide({"messages": [{"role": "user", "content": "x" * 10}]}, chat=True, threshold=1000)
    assert d.source == "bound"


def test_the_local_tokenizer_beats_the_engine() -> None:
    d, asked = decide({"prompt": "x" * 400}, per_char=0.25, engine=10_000)
    assert (d.disaggregate, d.source, d.tokens, d.exact, asked) == (True, "tokenizer", 104, True, 0)
    d, _ = decide({"prompt": "x" * 300}, per_char=0.25)
    assert (d.disaggregate, d.tokens) == (False, 79)


def test_the_engine_counts_when_nothing_local_can_and_its_ids_are_kept() -> None:
    d, asked = decide({"prompt": "x" * 400}, engine=150)
    assert (d.disaggregate, d.source, d.tokens, d.exact, asked) == (True, "engine", 150, True, 1)
    assert d.ids == list(range(150))


def test_a_failed_tokenize_falls_back_to_an_estimate() -> None:
    d, asked = decide({"prompt": "x" * 404}, engine=TokenizeError("down"))
    assert (d.disaggregate, d.source, d.tokens, d.exact, d.ids, asked) == (
        True,
        "estimate",
        102,
        False,
        None,
        1,
    )
