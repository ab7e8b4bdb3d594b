"""``make bench``'s measurement of what the engines' KV-cache events cost the router (issue 23,
item 7), in this process, not asserted in a timed test:

- **The decision with events on and off**, ``pd_router.decide.Decider`` as the router builds it,
  on token-id prompts (so neither side tokenizes) against two decoders, one holding the prompt's
  first half: a short prompt (300 tokens, below the threshold: events are not consulted) and a
  long one (8,000 tokens, threshold 1,024: the request's 500 blocks of 16 tokens are chained and
  looked up per engine). CPU per decision (``time.process_time``), averaged. A chat prompt on
  the events path also pays one ``/tokenize`` round trip to an engine (its ids as vLLM renders
  them), which this figure leaves out: it is an HTTP request like the ones ``make bench``'s
  matrix measures, made only for prompts at or above the threshold.
- **The router's CPU per request, events on and off**, through the whole router process: two
  simulated engines (zero delay, NIXL) that publish their KV events (pd_router_dev.sim), the
  router given a tokenizer that counts as they do (so the events path's ``/tokenize`` round trip
  is an extra), ``listen.workers: 1``; sequential chat requests, short ones (50 tokens, the
  direct route) and long ones (2,000 tokens, each new: the NIXL route), the router process's CPU
  (``/proc/<pid>/stat``) per request; only the router's ``routing.kvEvents.enabled`` differs.
- **Ingest at 10,000 stored blocks per second**: a real ZMQ PUB in this process sends vLLM's
  wire (a ``BlockStored`` of 100 16-token blocks and the ``BlockRemoved`` of the batch before,
  100 batches a second) to a :class:`pd_router.kv_events.KvEventIndex` subscribed over
  loopback; the CPU of its thread (``/proc/self/task/<tid>/stat``) over the run, as a share of
  one core and per block. That thread is not the event loop: the loop only reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pd_router.config import KvEvents, Routing
from pd_router.decide import Decider, Pools
from pd_router.discovery import Endpoint
from pd_router.failures import TokenizeError
from pd_router.kv_events import Batch, BlockRemoved, BlockStored, EngineBlocks, KvEventIndex, Source

BLOCK = 16  # vLLM's default block on GPUs
INGEST_BLOCKS_PER_SECOND = 10_000
INGEST_SECONDS = 5.0
_TICK = os.sysconf("SC_CLK_TCK")


class _NoCounter:
    local = None


async def _no_tokenize(body: dict[str, Any], chat: bool) -> list[int]:
    raise TokenizeError("token-id prompts are not tokenized")


def _decider(events: KvEventIndex | None) -> Decider:
    return Decider(Routing(threshold=1024), _NoCounter(), events)  # type: ignore[arg-type]


async def _decide_all(
    dec: Decider, prompts: list[list[int]], pools: Pools, runs: int
) -> tuple[list[float], set[str]]:
    """CPU (us) of each decision after 10 of warm-up, and where their estimates came from."""
    cpu: list[float] = []
    estimates: set[str] = set()
    for i in range(runs + 10):
        body = {"model": "m", "prompt": prompts[i % len(prompts)], "max_tokens": 8}
        t0 = time.process_time()
        d = await dec.decide(body, False, _no_tokenize, pools)
        if dec.index is not None and d.decoder is not None and d.blocks is not None:
            dec.remember(d.decoder, d.blocks, pools.decoders)  # the router does, on the loop
        if i >= 10:
            cpu.append((time.process_time() - t0) * 1e6)
            estimates.add(d.estimate)
    return cpu, estimates


def _decision_rows(runs: int) -> list[dict[str, Any]]:
    d1, d2 = Endpoint("http://10.0.0.1:8000"), Endpoint("http://10.0.0.2:8000")
    p1 = Endpoint("http://10.0.0.3:8000")
    for ep in (d1, d2, p1):
        ep.generation = 1
    pools = Pools([d1, d2], [p1])
    rows = []
    for label, size in (("short (300 tokens, direct)", 300), ("long (8,000 tokens)", 8000)):
        prompts = [[(i * 7919 + j) % 32000 for j in range(size)] for i in range(8)]
        kv = KvEventIndex(KvEvents())
        half = EngineBlocks(1)
        for n, ids in enumerate(prompts):  # d2 holds every prompt's first half
            k = len(ids) // 2 // BLOCK
            half.apply(
                [BlockStored(list(range(n * 1000, n * 1000 + k)), None, ids[: k * BLOCK], BLOCK)]
            )
        kv.engines[d2.base] = half
        kv.engines[d1.base] = EngineBlocks(1)
        kv.engines[p1.base] = EngineBlocks(1)
        for mode, dec in (("off", _decider(None)), ("on", _decider(kv))):
            cpu, estimates = asyncio.run(_decide_all(dec, prompts, pools, runs))
            rows.append(
                {
                    "kind": "kv_events_decision",
                    "prompt": label,
                    "events": mode,
                    "cpu_us": statistics.fmean(cpu),
                    "estimate": ",".join(sorted(estimates)),
                }
            )
    return rows


def _thread_cpu(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _ingest_row() -> dict[str, Any]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    kv = KvEventIndex(KvEvents(port=0, replay_port=0))
    applied = 0

    def counted(outcome: str) -> None:
        nonlocal applied
        applied += outcome == "applied"

    kv.start(counted)
    kv.watch("decode", "e", 1, Source(f"tcp://127.0.0.1:{port}", None, b"kv"), 0)
    enc = msgspec.msgpack.Encoder()
    per_batch = 100
    batches = int(INGEST_BLOCKS_PER_SECOND / per_batch * INGEST_SECONDS)
    payloads = []
    for b in range(batches + 1):
        hashes = [(b * per_batch + i) * 2654435761 % (1 << 64) for i in range(per_batch)]
        events: list[Any] = [BlockStored(hashes, None, [b % 30000] * (per_batch * BLOCK), BLOCK)]
        if b:
            gone = [(h - per_batch * 2654435761) % (1 << 64) for h in hashes]  # the batch before
            events.insert(0, BlockRemoved(gone))
        payloads.append(enc.encode(Batch(time.time(), events)))
    # PUB/SUB joins asynchronously: send the first batch until it is heard
    seq = 0
    while not applied:
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), enc.encode(Batch(0.0, []))))
        seq += 1
        time.sleep(0.01)
    thread = kv._thread
    assert thread is not None and thread.native_id is not None
    c0, w0, n0 = _thread_cpu(thread.native_id), time.monotonic(), applied
    interval = 1 / (INGEST_BLOCKS_PER_SECOND / per_batch)
    for i, p in enumerate(payloads):
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), p))
        seq += 1
        lag = w0 + (i + 1) * interval - time.monotonic()
        if lag > 0:
            time.sleep(lag)  # pacing the publisher at the target rate
    deadline = time.monotonic() + 10
    while applied - n0 < len(payloads) and time.monotonic() < deadline:
        time.sleep(0.01)
    cpu, wall = _thread_cpu(thread.native_id) - c0, time.monotonic() - w0
    blocks = (applied - n0) * per_batch
    kv.stop()
    pub.close(linger=0)
    ctx.term()
    return {
        "kind": "kv_events_ingest",
        "blocks_per_second": blocks / wall,
        "core_share": cpu / wall,
        "us_per_block": cpu / max(1, blocks) * 1e6,
        "blocks": blocks,
    }


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _chat(url: str, text: str) -> str:
    body = {
        "model": "llama-3.3-70b",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
        return r.headers.get("x-pd-route", "")


def _wait_ready(url: str, timeout_s: float = 30) -> None:
    """Until the router serves a request (both engines admitted, and heard when events are on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _chat(url, "warm up") == "direct":
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)  # polling a start-up


def _router_rows(requests: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from pd_router_dev import multiturn
    from pd_router_dev.devstack import Stack, free_port
    from pd_router_dev.sim.kv_events import config_json

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wd = Path(tmp)
        st = Stack(wd)
        try:
            tok = multiturn.word_tokenizer(wd / "tokenizer.json")
            for mode in ("off", "on"):
                # fresh engines for each: a router's replay on subscribing must not read the
                # other run's history inside the measurement
                rng = random.Random(23)  # the same prompts for both
                flags = [
                    ("--kv-connector", "nixl", "--kv-events-config", config_json(*ports))
                    for ports in ((free_port(), free_port()), (free_port(), free_port()))
                ]
                pre = st.sim(f"kvc-prefill-{mode}", *flags[0])
                dec = st.sim(f"kvc-decode-{mode}", *flags[1])
                name = f"kvc-router-{mode}"
                cfg_path = wd / f"{name}.yaml"
                cfg_path.write_text(
                    json.dumps(
                        {
                            "listen": {"workers": 1},
                            "model": {"tokenizer": str(tok)},
                            "routing": {
                                "connector": "nixl",
                                "threshold": 1024,
                                "kvEvents": {"enabled": mode == "on", "port": 0, "replayPort": 0},
                            },
                            "pools": {
                                "prefill": {"discovery": "static", "static": [pre.url()]},
                                "decode": {"discovery": "static", "static": [dec.url()]},
                            },
                        }
                    )
                )
                router = st.router(name, cfg_path)
                _wait_ready(router.url())
                for kind, size in (
                    ("short (50 tokens, direct)", 50),
                    ("long (2,000 tokens, NIXL)", 2000),
                ):
                    texts = [
                        " ".join(rng.choice(_WORDS) for _ in range(size)) for _ in range(requests)
                    ]
                    routes: set[str] = set()
                    c0 = _proc_cpu(router.pid)
                    for t in texts:
                        routes.add(_chat(router.url(), t))
                    cpu = _proc_cpu(router.pid) - c0
                    rows.append(
                        {
                            "kind": "kv_events_router",
                            "prompt": kind,
                            "events": mode,
                            "cpu_us": cpu / requests * 1e6,
                            "routes": ",".join(sorted(routes)),
                        }
                    )
                for p in (router, pre, dec):
                    p.stop()
                log(f"kv events: router CPU per request measured with events {mode}")
        finally:
            st.stop()
    return rows


_WORDS = [a + b + c for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]


def run(runs: int = 200, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rows = _decision_rows(runs)
    rows += _router_rows(200, log)
    log("kv events: decisions measured; ingest at 10,000 blocks/s ...")
    rows.append(_ingest_row())
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "### The engines' KV-cache events (pd_router.kv_events)",
        "",
        "The decision's CPU with the events index on and off (token-id prompts, two decoders, "
        f"{BLOCK}-token blocks, threshold 1,024; a chat prompt on the events path adds one "
        "/tokenize round trip), and the ingest thread's CPU at 10,000 stored blocks per second "
        "(and as many removed), over real ZMQ on loopback.",
        "",
        "| prompt | events | decision CPU (us) | estimate from |",
        "|---|---|---:|---|",
    ]
    for r in rows:
        if r["kind"] == "kv_events_decision":
            est = r["estimate"] or "-"
            lines.append(f"| {r['prompt']} | {r['events']} | {r['cpu_us']:.0f} | {est} |")
    router = [r for r in rows if r["kind"] == "kv_events_router"]
    if router:
        lines += [
            "",
            "The router process's CPU per request (simulated engines publishing events; the "
            "router's own tokenizer; only `routing.kvEvents.enabled` differs):",
            "",
            "| prompt | events | router CPU per request (us) | routes |",
            "|---|---|---:|---|",
        ]
        for r in router:
            lines.append(f"| {r['prompt']} | {r['events']} | {r['cpu_us']:.0f} | {r['routes']} |")
    for r in rows:
        if r["kind"] == "kv_events_ingest":
            lines += [
                "",
                f"Ingest: {r['blocks_per_second']:,.0f} blocks/s stored (and removed) for "
                f"{r['blocks']:,} blocks: {r['core_share'] * 100:.1f} % of one core, "
                f"{r['us_per_block']:.1f} us per block, on the index's own thread.",
            ]
    return lines


if __name__ == "__main__":
    out = run()
    print("\n".join(table(out)))
