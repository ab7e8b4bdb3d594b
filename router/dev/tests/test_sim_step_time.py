"""The simulator's ``--step-time max`` (sim/engine.py): a step lasts the larger of its
compute-bound time (every token of the step) and its memory-bound time (one read of the
weights plus the decoding sequences' KV), so decodes batched with a prefill chunk cost next
to nothing and no forward pass is shorter than one read of the weights; ``sum`` unchanged.

Not in the repository's pytest ``testpaths``: run ``pytest router/dev/tests``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pd_router_dev.sim import engine as E
from pd_router_dev.sim.metrics import VllmMetrics


@dataclass
class Cfg:
    step_time: str
    prefill_ms_per_token: float = 1.0
    decode_step_ms: float = 10.0
    decode_step_ms_per_seq: float = 2.0
    slow_factor: float = 20.0
    max_num_batched_tokens: int = 100
    max_num_seqs: int = 1024


def durations(cfg: Cfg, prompts: list[tuple[int, int]]) -> list[float]:
    """Each step's duration (ms), recorded instead of slept, until every sequence is done."""

    async def go() -> list[float]:
        metrics = VllmMetrics("m", 4096, "none", "0.31")
        eng = E.Engine(cfg, {"fault": "none"}, metrics)
        runs = []
        for i, (n_prompt, max_tokens) in enumerate(prompts):
            r = E.Run(metrics, 1)
            E.Seq(r, i, 0, [5] * n_prompt, max_tokens, 4096, n_prompt, ignore_eos=True)
            runs.append(r)
        out: list[float] = []

        async def record(seconds: float) -> None:
            out.append(round(seconds * 1000, 6))
            await asyncio.sleep(0)

        eng.sleep = record
        eng.submit([r.seqs[0] for r in runs])
        for r in runs:
            while (await r.queue.get()).finish is None:
                pass
        assert eng.task is not None
        eng.task.cancel()
        return out

    return asyncio.run(go())


def test_max_is_the_roofline_of_each_step() -> None:
    # A (10-token prompt) and B (250) together, budget 100, as the fidelity test's sum case:
    # 1: 100 prompt tokens -> max(100, 10)      2: A decodes + 99 of B -> max(100, 12)
    # 3: A decodes + B's last 61 -> max(62, 12)  then 2 decodes -> max(2, 14), 1 -> max(1, 12)
    got = durations(Cfg("max"), [(10, 6), (250, 6)])
    assert got == [100.0, 100.0, 62.0, 14.0, 14.0, 14.0, 12.0, 12.0]
    # sum charges the mixed steps the decode's weight read on top (the fidelity test's figures)
    assert durations(Cfg("sum"), [(10, 6), (250, 6)]) == [
        100.0, 111.0, 73.0, 14.0, 14.0, 14.0, 12.0, 12.0,
    ]  # fmt: skip


def test_a_short_prefill_takes_one_read_of_the_weights() -> None:
    # a 1-token prompt (a NIXL decoder's first step): max(1 ms, 10 ms) vs sum's 1 ms
    assert durations(Cfg("max"), [(1, 2)]) == [10.0, 12.0]
    assert durations(Cfg("sum"), [(1, 2)]) == [1.0, 12.0]
