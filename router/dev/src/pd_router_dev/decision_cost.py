"""``make bench``'s measurement of what the routing decision costs (issue 15, item 4): at most
1 ms of synchronous work per request on the event loop, and an 8,000-token prompt decided in
at most 2 ms of CPU (bounds that decide without exact counting where they can, exact counting
off the loop when needed). Measured here, in this process, not asserted in a timed test.

``pd_router.decide.Decider`` as the router builds it, with a real ``tokenizers`` byte-level
BPE tokenizer (16,000 tokens, as Llama 3's and GPT's are byte-level BPE) trained here on most
of the Python documentation's topics (``pydoc_data.topics``, in the standard library: nothing
is downloaded); the prompts are ~8,000-token chat requests cut from the held-out topics (about
4 bytes per token, printed). Cases, each with ``decision: length`` and ``decision: prefix``:

- far from the threshold (``threshold`` 1024, the prompt 8 times it): the sampled estimate
  decides, its middle 512-character window alone (``pd_router.tokens.TokenCounter.size`` in a
  worker thread);
- near it (``threshold`` = the prompt's size): all three windows, then the exact count, in the
  same worker thread hop (``encode_batch`` releases the GIL), the loop waiting.

``decision: prefix`` also hashes the prompt's 256-byte blocks and looks them up per decoder, and
the router then records them on the chosen decoder (``Decider.remember``, synchronous, on the
loop); both are in its figures. Per case, averaged over ``runs`` decisions after a warm-up,
the prompts in turn:

- the loop thread's CPU (``time.thread_time()`` of the loop thread around the awaited
  decision, the worker thread left out);
- the time the loop was blocked: the decision's wall time less the time the loop spent
  waiting in its selector (a selector that times its ``select``), i.e. the synchronous work
  no other request could interleave with. It is the figure for the 1 ms target: a
  ``tokenizers`` ``encode_batch`` called on the loop runs on its own Rayon threads
  (``TOKENIZERS_PARALLELISM``) while the loop thread waits, so the loop thread's CPU alone
  would understate how long the loop stood still (the router now samples in a worker thread,
  after this measurement showed the loop blocked 0.7 ms by it);
- the process's CPU (``time.process_time()``: every thread) for the 2 ms target, which issue 15
  sets for the decisions bounds make; an exact count (near the threshold) is the part it
  moves off the loop, its CPU shown for information;
- the wall time.
"""

from __future__ import annotations

import asyncio
import selectors
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pd_router.config import PrefixCache, Routing
from pd_router.decide import Decider, Pools
from pd_router.discovery import Endpoint
from pd_router.failures import TokenizeError
from pd_router.tokens import TokenCounter

LOOP_TARGET_MS = 1.0  # event-loop CPU per decision, at most
TOTAL_TARGET_MS = 2.0  # process CPU per decision of an 8,000-token prompt, at most
PROMPT_TOKENS = 8000
VOCAB = 16000


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    near: bool  # threshold at the prompt's size (exact count) or far below it (sampled)
    decision: str


CASES = (
    Case("far-length", "far from the threshold, decision: length", False, "length"),
    Case("far-prefix", "far from the threshold, decision: prefix", False, "prefix"),
    Case("near-length", "near the threshold, decision: length", True, "length"),
    Case("near-prefix", "near the threshold, decision: prefix", True, "prefix"),
)


def corpus() -> tuple[list[str], str]:
    """(training texts, held-out text) from the standard library's documentation topics."""
    from pydoc_data import topics

    docs = [topics.topics[k] for k in sorted(topics.topics)]
    cut = len(docs) * 4 // 5
    return docs[:cut], "\n\n".join(docs[cut:])


def train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def prompts(tok: Any, text: str, n: int, size: int = PROMPT_TOKENS) -> list[str]:
    """``n`` different texts of ``size`` tokens each, cut from ``text`` at spread offsets."""
    text = text + "\n\n" + text  # enough to wrap around
    step = max(1, (len(text) // 2) // n)
    out = []
    for i in range(n):
        window = text[i * step : i * step + size * 8]
        enc = tok.encode(window, add_special_tokens=False)
        out.append(window[: enc.offsets[min(size, len(enc.offsets)) - 1][1]])
    return out


def _body(text: str) -> dict[str, Any]:
    return {
        "model": "llama-3.3-70b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 64,
        "stream": True,
    }


async def _no_tokenize(body: dict[str, Any], chat: bool) -> list[int]:
    raise TokenizeError("not used: the local tokenizer counts")


class _TimedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's selector, adding up the seconds spent waiting in ``select``."""

    idle = 0.0

    def select(self, timeout: float | None = None) -> Any:
        t = time.perf_counter()
        try:
            return super().select(timeout)
        finally:
            self.idle += time.perf_counter() - t


async def _measure(
    decider: Decider,
    bodies: list[dict[str, Any]],
    pools: Pools,
    runs: int,
    warmup: int,
    sel: _TimedSelector,
) -> dict[str, Any]:
    loop_ms: list[float] = []
    blocked_ms: list[float] = []
    total_ms: list[float] = []
    wall_ms: list[float] = []
    sources: dict[str, int] = {}
    reasons: dict[str, int] = {}
    prefix = decider.index is not None
    for i in range(warmup + runs):
        body = bodies[i % len(bodies)]
        t0, p0, w0, i0 = time.thread_time(), time.process_time(), time.perf_counter(), sel.idle
        d = await decider.decide(body, True, _no_tokenize, pools)
        if prefix and d.decoder is not None and d.blocks is not None:
            decider.remember(d.decoder, d.blocks, pools.decoders)  # the router does, on the loop
        t1, p1, w1, i1 = time.thread_time(), time.process_time(), time.perf_counter(), sel.idle
        if i < warmup:
            continue
        loop_ms.append((t1 - t0) * 1000)
        blocked_ms.append((w1 - w0 - (i1 - i0)) * 1000)
        total_ms.append((p1 - p0) * 1000)
        wall_ms.append((w1 - w0) * 1000)
        sources[d.source] = sources.get(d.source, 0) + 1
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
    return {
        "loop_cpu_ms": statistics.fmean(loop_ms),
        "loop_blocked_ms": statistics.fmean(blocked_ms),
        "loop_blocked_p99_ms": _p99(blocked_ms),
        "total_cpu_ms": statistics.fmean(total_ms),
        "wall_ms": statistics.fmean(wall_ms),
        "sources": sources,
        "reasons": reasons,
    }


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def run(runs: int = 100, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per case (``kind: decision_cost``)."""
    t0 = time.process_time()
    train, held_out = corpus()
    tok = train_tokenizer(train)
    train_s = time.process_time() - t0
    texts = prompts(tok, held_out, 8)
    bodies = [_body(t) for t in texts]
    counter = TokenCounter("", "llama-3.3-70b")
    counter.use(tok, "file")
    sizes = [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]
    nbytes = [len(t.encode()) for t in texts]
    bytes_per_token = sum(nbytes) / sum(sizes)
    log(
        f"  decision cost: tokenizer trained in {train_s:.1f} s CPU; {len(texts)} prompts of "
        f"{min(sizes):,}-{max(sizes):,} tokens, {bytes_per_token:.2f} bytes/token"
    )
    decoders = [Endpoint("http://127.0.0.1:9000"), Endpoint("http://127.0.0.1:9001")]
    prefillers = [Endpoint("http://127.0.0.1:9100")]
    for e in (*decoders, *prefillers):
        e.healthy = True
    pools = Pools(decoders, prefillers)
    rows = []
    try:
        for case in CASES:
            # near: the threshold at the prompt's size, inside the sampled estimate's margin
            threshold = PROMPT_TOKENS if case.near else 1024
            routing = Routing(
                connector="nixl",
                threshold=threshold,
                decision=case.decision,  # type: ignore[arg-type]
                prefix_cache=PrefixCache(),
            )
            decider = Decider(routing, counter)
            n = runs
            sel = _TimedSelector()
            loop = asyncio.SelectorEventLoop(sel)
            try:
                res = loop.run_until_complete(
                    _measure(decider, bodies, pools, n, max(2, n // 10), sel)
                )
            finally:
                loop.close()
            row = {
                "kind": "decision_cost",
                "case": case.key,
                "label": case.label,
                "decision": case.decision,
                "threshold": threshold,
                "runs": n,
                "prompt_tokens": statistics.fmean(sizes),
                "bytes_per_token": bytes_per_token,
                **res,
                "loop_ok": res["loop_blocked_ms"] <= LOOP_TARGET_MS,
                # issue 15's 2 ms is for what bounds decide; an exact count goes off the loop
                "total_ok": None if case.near else res["total_cpu_ms"] <= TOTAL_TARGET_MS,
            }
            log(
                f"  decision cost: {case.label:42s} loop blocked {row['loop_blocked_ms']:.3f} ms"
                f" (its thread's CPU {row['loop_cpu_ms']:.3f}), process CPU "
                f"{row['total_cpu_ms']:.3f} ms, wall {row['wall_ms']:.2f} ms "
                f"({', '.join(row['sources'])})"
            )
            rows.append(row)
    finally:
        counter.close()
    return rows
