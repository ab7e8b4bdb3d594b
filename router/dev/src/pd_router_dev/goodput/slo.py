"""The SLOs and goodput. The SLOs come from the same engines' unloaded latencies, measured at
the start of the run: TTFT against prompt length (a least-squares line over requests sent one at
a time) and the median gap between tokens of a lone stream; each bound is a multiple of the
unloaded figure (DistServe sets its SLOs the same way, as a multiple of one request's latency
alone): 3 x for TTFT, 5 x for ITL, about what chat services ask of GPUs (a first token within
a second or two, tokens 50-100 ms apart, against 10-20 ms unloaded). The ITL multiple is the
larger because a step that carries a short prompt's prefill is slower than a decode step alone
and should not count as a stall: what the ITL bound must catch is a long prompt's prefill
stalling the streams of its engine. So the ITL bound is also at least ``SHORT_STEP_SCALE`` x the
unloaded step that carries the longest short prompt of the mixes (a gap plus its prefill, from
the TTFT line's slope). On an H100 a 300-token prefill takes less than a decode step and 5 x
rules; on the CPU build it takes 7-13 decode steps, and how many depends on the machine: run R
(2026-12-06) measured a 10.4 ms gap, a later machine 5.8 ms with the same prefill speed, and
there 5 x (29 ms) made every short prompt's prefill a stall for the streams beside it (colocated,
fixed split and the goodput decision all met both SLOs for under a tenth of mixed traffic at
0.9). A request is good when it was answered whole, its TTFT is within
``ttft + ttft_per_token x prompt tokens`` and its ITL p95 within ``itl``; goodput is good
requests per second of arrivals (DistServe's definition)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pd_router_dev.goodput.client import Record

TTFT_SCALE = 3.0  # TTFT SLO = 3 x the unloaded TTFT
ITL_SCALE = 5.0  # ITL SLO = 5 x the unloaded gap between tokens
SHORT_STEP_SCALE = 1.25  # ... and at least 1.25 x the unloaded step carrying a short prompt
# how a run's SLOs were set, kept in its result (report.py prints it; runs before it had no floor)
RULE_BEFORE = (
    f"{TTFT_SCALE:g} x the engines' unloaded TTFT and {ITL_SCALE:g} x their unloaded gap "
    "between tokens"
)
RULE = (
    f"{RULE_BEFORE}, at least {SHORT_STEP_SCALE:g} x their step carrying the longest short "
    "prompt's prefill"
)


@dataclass(frozen=True)
class Unloaded:
    ttft: float  # seconds, at 0 prompt tokens (the line's intercept)
    ttft_per_token: float
    itl: float  # median gap between two tokens of a lone stream

    @staticmethod
    def fit(samples: list[tuple[int, float]], gaps: list[float]) -> Unloaded:
        """Least squares over (prompt tokens, TTFT) samples; the median of ``gaps``."""
        n = len(samples)
        mx = sum(x for x, _ in samples) / n
        my = sum(y for _, y in samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in samples)
        b = sum((x - mx) * (y - my) for x, y in samples) / sxx if sxx else 0.0
        b = max(b, 0.0)
        a = max(my - b * mx, min(y for _, y in samples) / 2)
        return Unloaded(a, b, statistics.median(gaps))


@dataclass(frozen=True)
class Slo:
    ttft: float
    ttft_per_token: float
    itl: float

    @staticmethod
    def of(u: Unloaded, short_prompt: int) -> Slo:
        """The SLOs of engines measured as ``u``, for traffic whose short prompts have at most
        ``short_prompt`` tokens."""
        itl = max(u.itl * ITL_SCALE, SHORT_STEP_SCALE * (u.itl + u.ttft_per_token * short_prompt))
        return Slo(u.ttft * TTFT_SCALE, u.ttft_per_token * TTFT_SCALE, itl)

    def ttft_bound(self, prompt_tokens: int) -> float:
        return self.ttft + self.ttft_per_token * prompt_tokens

    def good(self, r: Record) -> bool:
        return (
            r.ok
            and r.ttft is not None
            and r.ttft <= self.ttft_bound(r.prompt_tokens)
            and r.itl_p95() <= self.itl
        )

    def router(self) -> dict[str, float]:
        """The router's ``routing.goodput`` for these SLOs."""
        return {
            "ttftSeconds": round(self.ttft, 6),
            "ttftSecondsPerKiloToken": round(self.ttft_per_token * 1000, 6),
            "itlSeconds": round(self.itl, 6),
        }

    def describe(self) -> str:
        return (
            f"TTFT <= {self.ttft * 1000:.0f} ms + {self.ttft_per_token * 1e6:.1f} ms per 1,000 "
            f"prompt tokens, ITL p95 <= {self.itl * 1000:.0f} ms"
        )

    def asdict(self) -> dict[str, float]:
        return asdict(self)


def goodput(slo: Slo, records: Iterable[Record], start: float, end: float) -> float:
    """Good requests per second among those arriving in [start, end)."""
    span = end - start
    return sum(1 for r in records if start <= r.at < end and slo.good(r)) / span


def prediction_errors(records: Iterable[Record]) -> list[float]:
    """|observed - predicted| / observed TTFT of every answered request that carried a
    prediction (the goodput decision's)."""
    return [
        abs(r.ttft - r.predicted_ttft) / r.ttft
        for r in records
        if r.ok and r.ttft and r.predicted_ttft is not None
    ]
