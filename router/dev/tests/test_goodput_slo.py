"""The sweep's SLOs from the unloaded latencies (pd_router_dev.goodput.slo)."""

from __future__ import annotations

import pytest

from pd_router_dev.goodput.slo import ITL_SCALE, SHORT_STEP_SCALE, TTFT_SCALE, Slo, Unloaded


def test_the_itl_bound_is_five_gaps_or_a_step_carrying_a_short_prompt_if_longer() -> None:
    # run R's engines (10.4 ms gap, 0.237 ms a prompt token): a 300-token step, 81 ms, x 1.25
    r = Unloaded(0.022, 0.000237, 0.0104)
    assert Slo.of(r, 300).itl == pytest.approx(SHORT_STEP_SCALE * (0.0104 + 0.000237 * 300))
    # run W's (5.8 ms gap, the same prefill): 5 x the gap alone, 29 ms, was below the step
    w = Unloaded(0.018, 0.000245, 0.0058)
    assert Slo.of(w, 300).itl == pytest.approx(SHORT_STEP_SCALE * (0.0058 + 0.000245 * 300))
    # negative control: prefills cheap next to a step (an H100's): 5 x the gap rules
    gpu = Unloaded(0.02, 0.00002, 0.012)
    assert Slo.of(gpu, 300).itl == pytest.approx(ITL_SCALE * 0.012)
    # the TTFT bounds are 3 x the line, whatever the prompts
    assert Slo.of(r, 300).ttft == Slo.of(r, 100).ttft == pytest.approx(TTFT_SCALE * 0.022)
