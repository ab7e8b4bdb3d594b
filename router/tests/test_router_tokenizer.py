"""Prompt-token counting for the routing decision: a local ``tokenizers`` file
(``model.tokenizer``), the engine's ``/tokenize``, and the estimate, each visible in
``pd_router_token_count_total{source}``; a bad tokenizer path stops start-up naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_router.config import ConfigError
from pd_router.tokens import TokenCounter
from pd_router_dev.devstack import Proc, Stack
from router_testlib import (
    TOKENIZER_ALLOWANCE as ALLOWANCE,
)
from router_testlib import (
    TOKENIZER_THRESHOLD as THRESHOLD,
)
from router_testlib import (
    TOKENIZER_WORD as WORD,
)
from router_testlib import (
    metric_value,
    post_json,
    run_cli,
    set_fault,
    train_tokenizer,
    write_config,
)


class Env:
    def __init__(self, stack: Stack, tok_dir: Path) -> None:
        self.stack = stack
        self.prefill = stack.sim("tk-prefill", "--kv-connector", "nixl")
        self.decode = stack.sim("tk-decode", "--kv-connector", "nixl")
        self.tok = train_tokenizer(tok_dir)
        self.local = self._router("tk-local", str(tok_dir))
        self.engine = self._router("tk-engine", "")

    def _router(self, name: str, tokenizer: str) -> Proc:
        cfg: dict[str, Any] = {
            "model": {"tokenizer": tokenizer},
            "routing": {"connector": "nixl", "threshold": THRESHOLD},
            "pools": {
                "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                "decode": {"discovery": "static", "static": [self.decode.url()]},
            },
        }
        return self.stack.router(name, write_config(self.stack.workdir, name, cfg))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def env(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield Env(stack, tmp_path_factory.mktemp("tok") / "model")


def _complete(router: Proc, text: str) -> tuple[str, str]:
    status, body, hdrs = post_json(
        router.url() + "/v1/completions", {"prompt": text, "max_tokens": 3, "ignore_eos": True}
    )
    assert status == 200, body
    return hdrs["x-pd-route"], body["choices"][0]["text"]


def _sources(router: Proc) -> dict[str, float]:
    return {
        s: metric_value(router.url(), "pd_router_token_count_total", {"source": s})
        for s in ("tokenizer", "engine", "estimate", "bound")
    }


def _token_sum(router: Proc) -> float:
    return metric_value(router.url(), "pd_router_prompt_tokens_sum")


def test_local_tokenizer_decides_the_route(env: Env) -> None:
    long_ = " ".join([WORD] * 30)  # engine: 31 tokens; ours: about 300 -> disaggregated
    short = " ".join([WORD] * 24)  # over the byte bound, yet under the threshold for ours
    assert len(short.encode()) + ALLOWANCE >= THRESHOLD  # the byte bound cannot decide it
    assert env.count(long_) + ALLOWANCE >= THRESHOLD > env.count(short) + ALLOWANCE
    r = env.local
    before, sum0 = _sources(r), _token_sum(r)
    assert _complete(r, long_)[0] == "disaggregated"
    assert _complete(r, short)[0] == "direct"
    after = _sources(r)
    assert after["tokenizer"] == before["tokenizer"] + 2
    assert after["engine"] == before["engine"] and after["estimate"] == before["estimate"]
    # the prompt-token histogram holds what our tokenizer counted (plus the allowance)
    expected = env.count(long_) + env.count(short) + 2 * ALLOWANCE
    assert _token_sum(r) == sum0 + expected


def test_a_decoder_that_cannot_count_is_replaced_by_a_prefiller(env: Env) -> None:
    """The decoder's /tokenize fails (a stalled decoder's too, once the stall watch ejects it):
    the prefiller counts the prompt, exactly, before the estimate is settled for."""
    long_ = " ".join([WORD] * 30)
    r = env.engine
    before, sum0 = _sources(r), _token_sum(r)
    set_fault(env.decode, "tokenize_error")
    try:
        assert _complete(r, long_)[0] == "direct"
    finally:
        set_fault(env.decode, "none")
    after = _sources(r)
    assert after["engine"] == before["engine"] + 1 and after["estimate"] == before["estimate"]
    assert _token_sum(r) == sum0 + 31  # BOS + one a word: the prefiller's exact count


def test_engine_tokenize_then_estimate(env: Env) -> None:
    long_ = " ".join([WORD] * 30)
    r = env.engine
    before, sum0 = _sources(r), _token_sum(r)
    # the engine's /tokenize counts 31 tokens (BOS + one a word): under the threshold
    assert _complete(r, long_)[0] == "direct"
    mid = _sources(r)
    assert mid["engine"] == before["engine"] + 1 and mid["tokenizer"] == before["tokenizer"]
    assert _token_sum(r) == sum0 + 31
    # /tokenize fails everywhere: the estimate (bytes / 4) is used, and counted as such
    for e in (env.decode, env.prefill):
        set_fault(e, "tokenize_error")
    try:
        sum1 = _token_sum(r)
        route, text = _complete(r, long_)
        assert route == "direct" and text
    finally:
        for e in (env.decode, env.prefill):
            set_fault(e, "none")
    after = _sources(r)
    assert after["estimate"] == mid["estimate"] + 1 and after["engine"] == mid["engine"]
    assert _token_sum(r) == sum1 + (len(long_.encode()) + ALLOWANCE) // 4
    assert metric_value(r.url(), "pd_router_upstream_errors_total", {"kind": "tokenize"}) >= 1


def test_tokenizer_file_path_and_directory(tmp_path: Path) -> None:
    tok = train_tokenizer(tmp_path / "m")
    text = " ".join([WORD] * 3)
    want = len(tok.encode(text, add_special_tokens=False).ids) + ALLOWANCE
    for spec in (tmp_path / "m", tmp_path / "m" / "tokenizer.json"):
        assert TokenCounter(str(spec), "m").local_count(text, ALLOWANCE) == want


def test_bad_tokenizer_path_stops_start_up(tmp_path: Path) -> None:
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "garbage.json").write_text('{"not": "a tokenizer"}')
    for bad in ("no/such/tokenizer.json", "empty-dir", "garbage.json"):
        spec = str(tmp_path / bad)
        with pytest.raises(ConfigError, match=r"^model\.tokenizer: "):
            TokenCounter(spec, "m")
        cfg = write_config(tmp_path, "bad-tok", {"model": {"tokenizer": spec}})
        out = run_cli("serve", "--config", str(cfg))
        assert out.returncode == 2, out.stderr
        assert "invalid config: model.tokenizer" in out.stderr
