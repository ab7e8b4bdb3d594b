"""The routing decision against vLLM's real prefix cache: per request, the router's estimate of
what the chosen decoder holds (``pd_router_prefix_matched_tokens``) against what vLLM reports it
reused (``vllm:prompt_tokens_by_source_total{source="local_cache_hit"}``), on a multi-turn chat
and on agents that share a system prompt and a task but each bring their own tools.

Measured on vLLM 0.31.0's CPU build (128-token blocks), one decoder, threshold 512, one request
at a time (2026-12-02; each run writes its rows to prefix-estimates.json in the tier's work
folder, and the last test prints them):

    workload          requests  estimate = reused  over vLLM's  mean |error|  decisions as vLLM's
    multi-turn chat          6                 4/6          0/6     43 tokens                6/6
    agents, own tools        9                 4/9          0/9    199 tokens                9/9

The estimate is biased low on purpose (pd_router.prefix): it misses what vLLM reuses of an
agent's system prompt (the tiny model's template, like Qwen's and Llama 3.x's, renders it before
the tools, while the router hashes the tools first: 512 tokens on each agent's first step) and
the answers the decoder generated and cached (one block, now and then), and never claims more
than vLLM had, which would make the decoder prefill a long prompt itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.prompts import ask, text

HIT = "vllm:prompt_tokens_by_source_total"
MATCHED = "pd_router_prefix_matched_tokens_sum"
THRESHOLD = 512  # the dev environment's router.threshold (conftest's router renders it)
BLOCK = 128  # the CPU build's KV block; the router reads it from vllm:cache_config_info


@dataclass
class Row:
    workload: str
    step: str
    prompt_tokens: int
    estimate: int
    reused: int
    route: str
    reason: str

    @property
    def vllm_route(self) -> str:
        """The route vLLM's own numbers imply: disaggregate what the decoder would recompute."""
        return "disaggregated" if self.prompt_tokens - self.reused >= THRESHOLD else "direct"

    @property
    def taken(self) -> str:
        return "disaggregated" if self.route == "disaggregated" else "direct"


class Meter:
    def __init__(self, router: Proc, decoder: engines.Engine, model: str) -> None:
        self.router, self.decoder, self.model = router, decoder, model
        self.rows: list[Row] = []

    def ask(self, workload: str, step: str, messages: list[dict[str, Any]], **extra: Any) -> str:
        hit0 = engines.value(self.decoder.metrics(), HIT, source="local_cache_hit")
        est0 = engines.value(engines.metrics_text(self.router.url()), MATCHED)
        got = ask(self.router.url(), self.model, True, messages, False, max_tokens=16, **extra)
        hit1 = engines.value(self.decoder.metrics(), HIT, source="local_cache_hit")
        est1 = engines.value(engines.metrics_text(self.router.url()), MATCHED)
        assert got.prompt_tokens
        self.rows.append(
            Row(workload, step, got.prompt_tokens, int(est1 - est0), int(hit1 - hit0), got.route, got.reason)
        )
        return got.text


SYSTEM = "You are an agent of the platform team. " + text("system", 300)
TASK = "Task: " + text("task", 120)


def tools(seed: str, n: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"{seed}_tool_{i}",
                "description": text(f"{seed}-{i}", 40),
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
        for i in range(n)
    ]


def multi_turn(m: Meter, turns: int = 6) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        msgs.append({"role": "user", "content": text(f"turn-{t}", 90)})
        answer = m.ask("multi-turn chat", f"turn {t + 1}", msgs)
        msgs.append({"role": "assistant", "content": answer})


def agents(m: Meter, n: int = 3, steps: int = 3) -> None:
    for a in range(n):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        own = tools(f"agent{a}")
        for s in range(steps):
            # tool_choice none: the dev environment renders no --tool-call-parser (model.toolCallParser)
            m.ask("agents with own tools", f"agent {a + 1} step {s + 1}", msgs, tools=own, tool_choice="none")
            call = {
                "id": f"call_{a}_{s}",
                "type": "function",
                "function": {"name": own[s % 3]["function"]["name"], "arguments": "{}"},
            }
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": text(f"result-{a}-{s}", 60)})


@pytest.fixture(scope="module")
def measured(router: Proc, pd: dict[str, engines.Engine], model_name: str, workdir: Path) -> list[Row]:
    m = Meter(router, pd["decode"], model_name)
    multi_turn(m)
    agents(m)
    (workdir / "prefix-estimates.json").write_text(json.dumps([asdict(r) for r in m.rows], indent=1))
    return m.rows


def summary(rows: list[Row]) -> str:
    lines = [f"{'workload':24} {'step':18} {'prompt':>6} {'estimate':>8} {'reused':>6} {'route':>14} {'vLLM says':>14}"]
    for r in rows:
        lines.append(
            f"{r.workload:24} {r.step:18} {r.prompt_tokens:6} {r.estimate:8} {r.reused:6} {r.taken:>14} {r.vllm_route:>14}"
        )
    err = [abs(r.estimate - r.reused) for r in rows]
    agree = sum(r.taken == r.vllm_route for r in rows)
    lines.append(
        f"mean |error| {sum(err) / len(err):.0f} tokens, max {max(err)}; decisions agreeing with vLLM {agree}/{len(rows)}"
    )
    return "\n".join(lines)


def test_the_estimate_is_whole_blocks_and_never_more_than_vllm_reused(measured: list[Row]) -> None:
    over = [r for r in measured if r.estimate > r.reused]
    assert not over, summary(measured)
    assert all(r.estimate % BLOCK == 0 for r in measured), summary(measured)


def test_the_next_turn_of_a_chat_is_found_on_its_decoder(measured: list[Row]) -> None:
    chat = [r for r in measured if r.workload == "multi-turn chat"]
    later = chat[1:]
    # every later turn: the estimate holds all but at most two blocks of what vLLM reused (the
    # answer the decoder generated and cached is unknown to the router; one block is rounding)
    assert all(r.estimate >= r.reused - 2 * BLOCK for r in later), summary(measured)
    assert all(r.estimate > 0 for r in later), summary(measured)


def test_agents_with_other_tools_are_never_taken_for_cached(measured: list[Row]) -> None:
    firsts = [r for r in measured if r.workload == "agents with own tools" and r.step.endswith("step 1")]
    assert len(firsts) == 3
    assert all(r.estimate == 0 for r in firsts), summary(measured)
    # and so each agent's first, long prompt is disaggregated, not prefilled on the decoder
    assert all(r.taken == "disaggregated" for r in firsts), summary(measured)


def test_decisions_agree_with_what_vllms_cache_implies(measured: list[Row]) -> None:
    wrong = [r for r in measured if r.taken != r.vllm_route]
    # a disagreement may only ever disaggregate what vLLM could have served from its cache
    assert all(r.taken == "disaggregated" for r in wrong), summary(measured)
    print("\n" + summary(measured))
