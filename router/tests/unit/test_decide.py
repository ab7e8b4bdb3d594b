"""The routing decision without I/O: every rung of the counting ladder, and when /tokenize is
(and is not) asked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pd_router.config import Routing
from pd_router.decide import Decider, Decision, Pools
from pd_router.failures import TokenizeError
from pd_router.tokens import SAMPLE_MARGIN, decided


class Counter:
    """A tokenizer of ``per_char`` tokens per character; ``sample_bias`` skews its sampled
    estimate (a prompt whose sampled windows are denser or sparser than the whole)."""

    def __init__(self, per_char: float | None, sample_bias: float = 1.0) -> None:
        self.local = object() if per_char is not None else None
        self.per_char = per_char
        self.sample_bias = sample_bias
        self.calls: list[str] = []

    def local_count(self, text: str, allowance: int) -> int:
        assert self.per_char is not None
        self.calls.append("inline")
        return int(len(text) * self.per_char) + allowance

    async def size(
        self, text: str, nbytes: int, allowance: int, threshold: int
    ) -> tuple[int, bool]:
        est = self.sampled(text, nbytes, allowance)
        if decided(est, threshold, SAMPLE_MARGIN):
            return est, False
        return await self.count(text, allowance), True

    def sampled(self, text: str, nbytes: int, allowance: int) -> int:
        assert self.per_char is not None
        self.calls.append("sampled")
        return int(nbytes * self.per_char * self.sample_bias) + allowance

    async def count(self, text: str, allowance: int) -> int:
        assert self.per_char is not None
        self.calls.append("off-loop")
        return int(len(text) * self.per_char) + allowance


def decide(
    body: dict[str, Any],
    chat: bool = False,
    threshold: int = 100,
    per_char=None,
    engine: Any = None,
    counter: Counter | None = None,
) -> tuple[Decision, int]:
    asked = 0

    async def tokenize(b: dict[str, Any], c: bool) -> list[int]:
        nonlocal asked
        asked += 1
        if isinstance(engine, Exception):
            raise engine
        return list(range(engine))

    c = counter or Counter(per_char)
    decider = Decider(Routing(threshold=threshold, decision="length"), c)  # type: ignore[arg-type]
    d = asyncio.run(decider.decide(body, chat, tokenize, Pools([], [])))
    return d, asked


@pytest.mark.parametrize(
    "body",
    [{"prompt": "x" * 1000, "n": 2}, {"prompt": ["a" * 500, "b" * 500]}, {"prompt": [[1, 2], [3]]}],
)
def test_batches_and_n_above_one_go_direct_uncounted(body: dict[str, Any]) -> None:
    d, asked = decide(body, engine=10_000)
    assert d == Decision(False, "skipped", "batch") and asked == 0


def test_threshold_zero_disaggregates_without_counting() -> None:
    d, asked = decide({"prompt": "hi"}, threshold=0, engine=5)
    assert d == Decision(True, "skipped", "always") and asked == 0


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


def test_long_prompts_far_from_the_threshold_are_decided_by_a_sample() -> None:
    # 8,000 bytes at 1 token / 4 bytes: an estimate of ~2,000 tokens against 4096 -> direct
    c = Counter(0.25)
    d, _ = decide({"prompt": "x" * 8000}, threshold=4096, counter=c)
    assert (d.disaggregate, d.source, d.exact, c.calls) == (False, "sampled", False, ["sampled"])
    c = Counter(1.0)  # ~8,000 tokens against 4096: disaggregated, nothing encoded whole
    d, _ = decide({"prompt": "x" * 8000}, threshold=4096, counter=c)
    assert (d.disaggregate, d.source, c.calls) == (True, "sampled", ["sampled"])


def test_prompts_near_the_threshold_are_counted_exactly_off_the_loop() -> None:
    # the sample says 1.2x the threshold (within the margin): the exact count decides, and
    # here it disagrees with the sample
    c = Counter(0.5, sample_bias=1.2)
    d, _ = decide({"prompt": "x" * 8000}, threshold=4096, counter=c)
    assert (d.disaggregate, d.source, d.tokens, d.exact) == (False, "tokenizer", 4004, True)
    assert c.calls == ["sampled", "off-loop"]


def test_short_texts_are_encoded_inline() -> None:
    c = Counter(1.0)
    d, _ = decide({"prompt": "x" * 1000}, threshold=500, counter=c)
    assert (d.source, c.calls) == ("tokenizer", ["inline"])


def test_the_real_tokenizer_counts_off_the_loop_and_samples_what_it_counts(tmp_path) -> None:
    from pd_router.tokens import TokenCounter
    from router_testlib import TOKENIZER_WORD, train_tokenizer

    train_tokenizer(tmp_path)
    counter = TokenCounter(str(tmp_path), "m")
    text = " ".join([TOKENIZER_WORD] * 2000)  # one token per character with this vocabulary
    nbytes = len(text.encode())
    try:
        exact = counter.local_count(text, 4)
        assert asyncio.run(counter.count(text, 4)) == exact == 2000 * len(TOKENIZER_WORD) + 4
        assert abs(counter.sampled(text, nbytes, 4) - exact) <= exact * 0.05
    finally:
        counter.close()


def test_a_prompt_far_beyond_the_threshold_is_sampled_in_one_window(tmp_path) -> None:
    from pd_router.tokens import FIRST_WINDOW_MARGIN, TokenCounter
    from router_testlib import TOKENIZER_WORD, train_tokenizer

    train_tokenizer(tmp_path)
    counter = TokenCounter(str(tmp_path), "m")
    real = counter.local
    batches: list[int] = []

    class Spy:
        def encode_batch(self, windows: list[str], **kw: Any) -> Any:
            batches.append(len(windows))
            return real.encode_batch(windows, **kw)

    counter.local = Spy()
    text = " ".join([TOKENIZER_WORD] * 2000)
    nbytes = len(text.encode())
    exact = 2000 * len(TOKENIZER_WORD) + 4
    try:
        far = int(exact / FIRST_WINDOW_MARGIN / 1.2)  # beyond the margin, and the sample error
        for threshold, windows in ((far, [1]), (exact, [1, 2]), (0, [1, 2])):
            batches.clear()
            assert abs(counter.sampled(text, nbytes, 4, threshold) - exact) <= exact * 0.05
            assert batches == windows, threshold
    finally:
        counter.close()
