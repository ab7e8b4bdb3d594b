"""``make bench``'s multi-turn chat scenario (issue 13, item 7): does deciding by what the
decoder already holds (``routing.decision: prefix``) beat deciding by the prompt's length
(``decision: length``) on a chat workload, at the same number of engines?

The workload, and why:

- **Chat sessions** start as a Poisson process (``session_rate``). A session has ``turns``
  turns; its first user message is long (``first_tokens``: a pasted document, a code file, a
  long question), above the threshold, so its first turn is disaggregated either way. Every
  later turn sends the whole conversation again, as chat clients do: the previous messages,
  the assistant's answer as the client received it, and a new user message of
  ``turn_tokens``, well below the threshold, after a think time (``think_s``). The context
  grows to several thousand tokens, so a length rule sends every later turn through the
  prefill pool again, although the decoder that served the previous turn holds all but the
  last answer and the new message in its prefix cache; the prefix decision serves it there
  (``prefix_cached``). No new turn starts after ``duration``.
- **Unrelated long prompts** (``long_rate``, ``long_tokens``: single-turn documents) keep
  the prefill pool doing what it is for, and, colocated, stall decodes.
- **Short requests** (``short_rate``, ``short_tokens``), below the threshold everywhere.
- Every session shares one system prompt (``system_tokens``), as deployments do.

Texts are random three-letter words: the simulator's tokenizer makes one token of each
(sim/model.py) and one token is then 4 bytes, the usual BPE figure, which the router's
prefix index assumes for text prompts (pd_router.prefix). The router is given a tokenizer
that counts as the simulator does (a ``tokenizers`` word-level tokenizer written into the
stack's folder, ``model.tokenizer``), as a deployment gives it the model's own, so it
counts locally (the sampled estimate far from the threshold, an exact count in a thread
near it) instead of asking an engine's ``/tokenize``. Chat completions (``/v1/chat/
completions``), streamed; the client times each token's SSE event (TTFT from sending the
request to its first token, ITL between successive tokens). The plan (who sends what, when)
is drawn once from ``seed``; the engines' answers are deterministic and the same on every
route (sim/model.py), so every setup replays the same conversations.

Setups, two simulated engines each with mixed.py's timing (``--step-time max``, chunked
prefill with an 8192-token budget, vLLM's prefix cache on: ``--prefix-cache-tokens``):

- colocated: both engines serve everything through the direct route (``threshold`` out of
  reach), the router choosing the engine by its prefix index (``decision: prefix``; the
  cache-aware choice llm-d or vllm-router's ``cache_aware`` policy would make), so a later
  turn finds its prefix on its engine there too;
- ``decision: length``: 1 prefill + 1 decode engine (NIXL), ``threshold`` tokens or more
  prefilled apart;
- ``decision: prefix``: the same engines and threshold, the new decision.

Per setup: TTFT (all requests and later turns, turn >= 2), ITL, the seconds each engine
spent in steps (``pd_sim_busy_seconds_total``: the prefill pool's busy time), prompt tokens
computed (``vllm:prompt_tokens_by_source{source="local_compute"}``), KV tokens the decoder
pulled over NIXL (``vllm:nixl_bytes_transferred`` / the simulator's bytes per token) and each
``x-pd-reason`` the client saw; ``bench.py`` sets the prefix decision against the length
rule (issue 13's targets: later-turn TTFT p50 at least 2x lower, ITL p99 within 10 %, fewer
KV tokens moved).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pd_router_dev.devstack import Stack, static_pools
from pd_router_dev.mixed import _pct, _router_config, _sim_args, _wait_ready
from pd_router_dev.sim.metrics import KV_BYTES_PER_TOKEN

MODEL = "llama-3.3-70b"
_LABEL = re.compile(r'(\w+)="([^"]*)"')

# issue 13, item 7: the prefix decision against the length rule
LATER_TTFT_TARGET = 0.5  # later-turn TTFT p50, prefix / length, at most (2x lower)
ITL_P99_TARGET = 1.1  # ITL p99, prefix / length, at most (within 10 %)
KV_TARGET = 1.0  # KV tokens moved, prefix / length, below


@dataclass(frozen=True)
class Spec:
    duration: float = 40.0  # seconds of arrivals: sessions, single prompts and turns start before
    session_rate: float = 0.5  # new chat sessions per second (Poisson)
    turns: tuple[int, int] = (3, 6)  # turns per session (uniform, inclusive)
    first_tokens: tuple[int, int] = (1500, 3000)  # the first user message
    turn_tokens: tuple[int, int] = (50, 300)  # each later user message
    think_s: tuple[float, float] = (0.5, 2.0)  # between an answer and the next turn
    system_tokens: int = 100  # the system prompt every session shares
    long_rate: float = 0.25  # unrelated single-turn long prompts per second (Poisson)
    long_tokens: tuple[int, int] = (4000, 8000)
    short_rate: float = 1.0  # short single-turn requests per second (Poisson)
    short_tokens: tuple[int, int] = (50, 300)
    max_tokens: int = 64  # every answer (ignore_eos)
    threshold: int = 1024  # routing.threshold of the disaggregated setups
    seed: int = 13
    # the engines, as mixed.Spec
    prefill_ms_per_token: float = 0.05
    decode_step_ms: float = 15.0
    decode_step_ms_per_seq: float = 0.05
    transfer_ms: float = 20.0
    step_time: str = "max"
    budget: int = 8192  # --max-num-batched-tokens
    prefix_cache_tokens: int = 262144  # per engine; also routing.prefixCache.capacityTokens

    def describe(self) -> str:
        def r(x: tuple[Any, Any]) -> str:
            return f"{x[0]:,}-{x[1]:,}"

        return (
            f"simulated engines: prefill {self.prefill_ms_per_token:g} ms/token, decode step "
            f"{self.decode_step_ms:g} ms + {self.decode_step_ms_per_seq:g} ms/sequence, step "
            f"time = {'max(compute, memory)' if self.step_time == 'max' else 'prefill + decode'}"
            f", chunked prefill budget {self.budget}, prefix cache {self.prefix_cache_tokens:,} "
            f"tokens per engine, NIXL KV transfer {self.transfer_ms:g} ms; for "
            f"{self.duration:g} s: {self.session_rate:g} chat sessions/s (Poisson) of "
            f"{self.turns[0]}-{self.turns[1]} turns, a shared {self.system_tokens}-token system "
            f"prompt, first user message {r(self.first_tokens)} tokens, later ones "
            f"{r(self.turn_tokens)} after {self.think_s[0]:g}-{self.think_s[1]:g} s; "
            f"{self.long_rate:g}/s unrelated prompts of {r(self.long_tokens)} tokens, "
            f"{self.short_rate:g}/s short ones of {r(self.short_tokens)}; {self.max_tokens} "
            f"output tokens, chat completions streamed; threshold {self.threshold}"
        )


@dataclass(frozen=True)
class Setup:
    key: str
    name: str
    disaggregated: bool
    decision: str  # routing.decision
    busy_tokens: int | None = None  # routing.prefillBusy.queuedTokens (None: the router's default)


SETUPS = (
    Setup("colocated", "colocated: 2 engines, direct route (prefix-aware choice)", False, "prefix"),
    Setup("pd-length", "1 prefill + 1 decode (NIXL), decision: length", True, "length"),
    Setup("pd-prefix", "1 prefill + 1 decode (NIXL), decision: prefix", True, "prefix"),
)


# --------------------------------------------------------------------------- the plan
@dataclass
class Session:
    sid: int
    start: float
    system: str
    users: list[str]  # one per turn
    think: list[float]  # after each turn's answer


@dataclass
class Single:
    kind: str  # long | short
    at: float
    text: str


@dataclass
class Plan:
    sessions: list[Session] = field(default_factory=list)
    singles: list[Single] = field(default_factory=list)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WORDS = [a + b + c for a in _LETTERS for b in _LETTERS for c in _LETTERS]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_WORDS, k=n))


def _arrivals(rng: random.Random, rate: float, duration: float, start: float) -> list[float]:
    """Poisson arrival times in [start, duration), the first at ``start`` (a short run has
    one)."""
    out: list[float] = []
    t = start
    while rate > 0 and t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def plan(spec: Spec) -> Plan:
    rng = random.Random(spec.seed)
    system = _text(rng, spec.system_tokens)
    p = Plan()
    for i, at in enumerate(_arrivals(rng, spec.session_rate, spec.duration, 0.0)):
        n = rng.randint(*spec.turns)
        users = [_text(rng, rng.randint(*spec.first_tokens))]
        users += [_text(rng, rng.randint(*spec.turn_tokens)) for _ in range(n - 1)]
        think = [rng.uniform(*spec.think_s) for _ in range(n)]
        p.sessions.append(Session(i, at, system, users, think))
    for kind, rate, size, start in (
        ("long", spec.long_rate, spec.long_tokens, 0.2),  # not with the first session
        ("short", spec.short_rate, spec.short_tokens, 0.1),
    ):
        for at in _arrivals(rng, rate, spec.duration, start):
            p.singles.append(Single(kind, at, _text(rng, rng.randint(*size))))
    return p


# --------------------------------------------------------------------------- the client
async def _drive(url: str, spec: Spec, pl: Plan) -> list[dict[str, Any]]:
    import aiohttp

    out: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=spec.duration + 180, sock_connect=5)
    start = time.perf_counter()

    async def until(at: float) -> None:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule, not a synchronisation

    async def ask(
        session: aiohttp.ClientSession, messages: list[dict[str, str]], rec: dict[str, Any]
    ) -> str:
        body = orjson.dumps(
            {
                "model": MODEL,
                "messages": messages,
                "max_tokens": spec.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        )
        rec.update(at=time.perf_counter() - start, tokens=[], ok=False)
        parts: list[str] = []
        t0 = time.perf_counter()
        try:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                rec["status"] = r.status
                rec["route"] = r.headers.get("x-pd-route", "")
                rec["reason"] = r.headers.get("x-pd-reason", "")
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        rec["ok"] = r.status == 200
                        break
                    ch = orjson.loads(payload).get("choices") or []
                    text = ch[0].get("delta", {}).get("content") if ch else None
                    if text:
                        rec["tokens"].append(time.perf_counter() - t0)
                        parts.append(text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            rec["error"] = repr(exc)
        out.append(rec)
        return "".join(parts)

    async def chat(session: aiohttp.ClientSession, s: Session) -> None:
        await until(s.start)
        messages = [{"role": "system", "content": s.system}]
        for turn, user in enumerate(s.users, 1):
            if turn > 1 and time.perf_counter() - start >= spec.duration:
                return
            messages.append({"role": "user", "content": user})
            rec: dict[str, Any] = {"kind": "chat", "session": s.sid, "turn": turn}
            answer = await ask(session, messages, rec)
            if not rec["ok"]:
                return
            messages.append({"role": "assistant", "content": answer})
            if turn < len(s.users):
                await asyncio.sleep(s.think[turn - 1])  # the user reading and typing

    async def single(session: aiohttp.ClientSession, p: Single) -> None:
        await until(p.at)
        await ask(session, [{"role": "user", "content": p.text}], {"kind": p.kind, "turn": 1})

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        jobs = [chat(session, s) for s in pl.sessions] + [single(session, p) for p in pl.singles]
        await asyncio.wait_for(asyncio.gather(*jobs), spec.duration + 240)
    return out


# --------------------------------------------------------------------------- metrics
def scrape(base: str) -> dict[str, float]:
    """A Prometheus text page as ``{'name{labels}': value}`` (``_created`` samples left out)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if "_created" in key.split("{", 1)[0]:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in want):
            total += v
    return total


def _router_decisions(m: dict[str, float]) -> dict[str, int]:
    """``pd_router_decisions_total`` as ``{'route/reason': n}`` (the ones seen)."""
    out: dict[str, int] = {}
    for key, v in m.items():
        if key.startswith("pd_router_decisions_total{") and v:
            labels = dict(_LABEL.findall(key))
            k = f"{labels.get('route', '')}/{labels.get('reason', '')}"
            out[k] = out.get(k, 0) + int(v)
    return dict(sorted(out.items()))


def engine_figures(m: dict[str, float]) -> dict[str, float]:
    return {
        "busy_s": metric(m, "pd_sim_busy_seconds_total"),
        "computed_tokens": metric(m, "vllm:prompt_tokens_by_source_total", source="local_compute"),
        "prefix_hit_tokens": metric(m, "vllm:prefix_cache_hits_total"),
        "kv_tokens_pulled": metric(m, "vllm:nixl_bytes_transferred_sum") / KV_BYTES_PER_TOKEN,
        "kv_transfers": metric(m, "vllm:nixl_bytes_transferred_count"),
    }


# --------------------------------------------------------------------------- one setup
def word_tokenizer(path: Path) -> Path:
    """A ``tokenizer.json`` that counts as the simulator's tokenizer does (sim/model.py: one
    token per word or punctuation mark): the router's ``model.tokenizer`` here."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if r["ok"] and r["tokens"]]

    def ttft(rs: list[dict[str, Any]]) -> list[float]:
        return [r["tokens"][0] * 1000 for r in rs]

    itl = [(b - a) * 1000 for r in ok for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
    later = [r for r in ok if r["kind"] == "chat" and r["turn"] >= 2]
    first = [r for r in ok if r["kind"] == "chat" and r["turn"] == 1]
    by_class: dict[str, Counter[str]] = {}
    for r in recs:
        cls = r["kind"] if r["kind"] != "chat" else ("later turn" if r["turn"] >= 2 else "turn 1")
        by_class.setdefault(cls, Counter())[r.get("reason") or "?"] += 1
    reasons = Counter(r.get("reason") or "?" for r in recs)
    routes = Counter(r.get("route") or "?" for r in recs)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "later_n": len(later),
        "first_n": len(first),
        "ttft_p50_ms": _pct(ttft(ok), 0.5),
        "ttft_p99_ms": _pct(ttft(ok), 0.99),
        "later_ttft_p50_ms": _pct(ttft(later), 0.5),
        "later_ttft_p99_ms": _pct(ttft(later), 0.99),
        "first_ttft_p50_ms": _pct(ttft(first), 0.5),
        "long_ttft_p50_ms": _pct(ttft([r for r in ok if r["kind"] == "long"]), 0.5),
        "short_ttft_p50_ms": _pct(ttft([r for r in ok if r["kind"] == "short"]), 0.5),
        "itl_p50_ms": _pct(itl, 0.5),
        "itl_p99_ms": _pct(itl, 0.99),
        "itl_samples": len(itl),
        "reasons": dict(sorted(reasons.items())),
        "reasons_by_class": {k: dict(sorted(v.items())) for k, v in sorted(by_class.items())},
        "routes": dict(sorted(routes.items())),
    }


def run_setup(
    setup: Setup,
    spec: Spec,
    pl: Plan,
    router_cpus: Collection[int] | None,
    other_cpus: Collection[int] | None,
) -> dict[str, Any]:
    extra = ("--prefix-cache-tokens", str(spec.prefix_cache_tokens))
    with Stack() as st:
        wd = st.workdir
        if setup.disaggregated:
            nixl = ("--kv-connector", "nixl", *extra)
            pre = st.sim("mt-prefill", *_sim_args(spec, spec.budget, *nixl), cpus=other_cpus)
            dec = st.sim("mt-decode", *_sim_args(spec, spec.budget, *nixl), cpus=other_cpus)
            engines = {"prefill": pre.url(), "decode": dec.url()}
            pools = static_pools([pre.url()], [dec.url()])
            threshold = spec.threshold
        else:
            e1 = st.sim("mt-engine-1", *_sim_args(spec, spec.budget, *extra), cpus=other_cpus)
            e2 = st.sim("mt-engine-2", *_sim_args(spec, spec.budget, *extra), cpus=other_cpus)
            engines = {"engine 1": e1.url(), "engine 2": e2.url()}
            # prefill pool unused: nothing reaches the threshold
            pools = static_pools([e1.url()], [e1.url(), e2.url()])
            threshold = 1 << 30
        tok = word_tokenizer(wd / "tokenizer.json")
        cfg = _router_config(
            wd,
            "mt-router",
            {
                "model": {"tokenizer": str(tok)},
                "routing": {
                    "connector": "nixl",
                    "threshold": threshold,
                    "decision": setup.decision,
                    "sessionAffinityHeader": "",
                    "prefixCache": {"capacityTokens": spec.prefix_cache_tokens},
                    **(
                        {}
                        if setup.busy_tokens is None
                        else {"prefillBusy": {"queuedTokens": setup.busy_tokens}}
                    ),
                },
                "pools": pools,
                "limits": {"maxInFlight": 1024, "maxQueued": 1024},
            },
        )
        router = st.router("mt-router", cfg, cpus=router_cpus)
        _wait_ready(router.url())
        t0 = time.monotonic()
        recs = asyncio.run(_drive(router.url() + "/v1/chat/completions", spec, pl))
        wall = time.monotonic() - t0
        figs = {name: engine_figures(scrape(url)) for name, url in engines.items()}
        decisions = _router_decisions(scrape(router.url()))
    row: dict[str, Any] = {
        "kind": "multiturn",
        "setup": setup.key,
        "label": setup.name,
        "decision": setup.decision,
        "disaggregated": setup.disaggregated,
        **_summary(recs),
        "wall_s": wall,
        "engines": figs,
        "engines_busy_s": sum(f["busy_s"] for f in figs.values()),
        "prefill_busy_s": figs["prefill"]["busy_s"] if setup.disaggregated else None,
        "computed_tokens": sum(f["computed_tokens"] for f in figs.values()),
        "kv_tokens_moved": sum(f["kv_tokens_pulled"] for f in figs.values()),
        "kv_transfers": sum(f["kv_transfers"] for f in figs.values()),
        "router_decisions": decisions,
        "spec": asdict(spec),
    }
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compare(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The prefix decision against the length rule, with issue 13's targets."""
    by = {r["setup"]: r for r in rows}
    new, old = by.get("pd-prefix"), by.get("pd-length")
    if not new or not old:
        return None
    later = _ratio(new["later_ttft_p50_ms"], old["later_ttft_p50_ms"])
    itl = _ratio(new["itl_p99_ms"], old["itl_p99_ms"])
    kv = _ratio(new["kv_tokens_moved"], old["kv_tokens_moved"])
    busy = _ratio(new["prefill_busy_s"], old["prefill_busy_s"])
    return {
        "kind": "multiturn_ratio",
        "later_ttft_p50": later,
        "later_ttft_p50_ok": later is not None and later <= LATER_TTFT_TARGET,
        "itl_p99": itl,
        "itl_p99_ok": itl is not None and itl <= ITL_P99_TARGET,
        "kv_tokens": kv,
        "kv_tokens_ok": kv is not None and kv < KV_TARGET,
        "prefill_busy": busy,
        "ttft_p50": _ratio(new["ttft_p50_ms"], old["ttft_p50_ms"]),
        "ttft_p99": _ratio(new["ttft_p99_ms"], old["ttft_p99_ms"]),
    }


def run(
    spec: Spec,
    router_cpus: Collection[int] | None,
    other_cpus: Collection[int] | None,
    log: Callable[[str], None] = print,
    setups: tuple[Setup, ...] = SETUPS,
) -> list[dict[str, Any]]:
    pl = plan(spec)
    turns = sum(len(s.users) for s in pl.sessions)
    log(
        f"  multi-turn: {len(pl.sessions)} sessions (up to {turns} turns), "
        f"{len(pl.singles)} single prompts per setup, {spec.duration:g} s each"
    )
    rows = []
    for setup in setups:
        row = run_setup(setup, spec, pl, router_cpus, other_cpus)
        log(
            f"  multi-turn: {setup.name:52s} later-turn TTFT p50 {_fmt(row['later_ttft_p50_ms'])}"
            f" ms, ITL p99 {_fmt(row['itl_p99_ms'], '{:.1f}')} ms, KV tokens moved "
            f"{row['kv_tokens_moved']:,.0f}, errors {row['errors']}"
        )
        rows.append(row)
    return rows


def _fmt(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


# A prefill-heavy burst for choosing routing.prefillBusy.queuedTokens (not part of make bench):
# unrelated long prompts at 2.5/s keep the one prefiller 75-90 % busy.
BURST = Spec(duration=30.0, session_rate=0.3, long_rate=2.5, short_rate=2.0)


def busy_sweep(values: list[int], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The prefix decision on 1 prefill + 1 decode under BURST, once per ``queuedTokens``."""
    setups = tuple(
        Setup(f"busy-{v}", f"decision: prefix, prefillBusy.queuedTokens {v}", True, "prefix", v)
        for v in values
    )
    rows = run(BURST, None, None, log, setups)
    for r in rows:
        log(
            f"  {r['label']:48s} TTFT p50/p99 {_fmt(r['ttft_p50_ms'])}/{_fmt(r['ttft_p99_ms'])} ms,"
            f" long TTFT p50 {_fmt(r['long_ttft_p50_ms'])} ms, ITL p50/p99 "
            f"{_fmt(r['itl_p50_ms'], '{:.1f}')}/{_fmt(r['itl_p99_ms'], '{:.1f}')} ms, "
            f"reasons {r['router_decisions']}"
        )
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m pd_router_dev.multiturn",
        description="The prefix decision under a prefill-heavy burst, per prefillBusy.queuedTokens",
    )
    ap.add_argument("--prefill-busy", default="0,16384,65536", help="queuedTokens values")
    busy_sweep([int(v) for v in ap.parse_args().prefill_busy.split(",")])
