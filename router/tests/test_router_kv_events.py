"""The router on the engines' KV-cache events, end to end on simulated vLLM engines that publish
them as vLLM does (``--kv-events-config``, pd_router_dev.sim.kv_events): ZMQ PUB and replay
over loopback, ``/kv_event_sources``, the router's subscriber thread, the decision. Per request
of a conversation, the router's estimate (``x-pd-cached-tokens``) equals what the decoder
reports it reused (``vllm:prompt_tokens_by_source_total{source="local_cache_hit"}``); after the
decoder's small cache was thrashed, nothing is claimed; a router started after the engines
served traffic knows their caches from the replay. The real engine is the oracle for the same
checks in tests/real_engine/test_real_kv_events.py."""

from __future__ import annotations

import uuid
from typing import Any

from pd_router_dev.devstack import Proc, Stack, free_port
from pd_router_dev.sim.kv_events import config_json, published
from router_testlib import MODEL, client, metric_value, wait_until, write_config

THRESHOLD = 256
HIT = "vllm:prompt_tokens_by_source_total"
APPLIED = "pd_router_kv_event_batches_total"


def events_config() -> tuple[str, str]:
    """(the flag's JSON, the replay endpoint to ask)."""
    replay = free_port()
    return config_json(free_port(), replay), f"tcp://127.0.0.1:{replay}"


class Setup:
    def __init__(self, stack: Stack, name: str, cache_tokens: int = 262144) -> None:
        self.stack, self.name = stack, name
        pc, self.prefill_replay = events_config()
        dc, self.decode_replay = events_config()
        common = ("--kv-connector", "nixl", "--prefix-cache-tokens", str(cache_tokens))
        self.prefill = stack.sim(f"{name}-p", *common, "--kv-events-config", pc)
        self.decode = stack.sim(f"{name}-d", *common, "--kv-events-config", dc)
        self.routers: list[Proc] = []

    def router(self, suffix: str) -> Proc:
        name = f"{self.name}-{suffix}"
        cfg = {
            "routing": {
                "connector": "nixl",
                "threshold": THRESHOLD,
                "kvEvents": {"port": 0, "replayPort": 0},  # engines sharing one host
            },
            "pools": {
                "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                "decode": {"discovery": "static", "static": [self.decode.url()]},
            },
        }
        r = self.stack.router(name, write_config(self.stack.workdir, name, cfg))
        wait_until(
            lambda: metric_value(r.url(), "pd_router_kv_events_engines", {"state": "exact"}) == 2,
            "both engines heard",
        )
        self.routers.append(r)
        return r

    def settle(self) -> None:
        target = published(self.prefill_replay) + published(self.decode_replay)
        for r in self.routers:
            wait_until(
                lambda r=r: metric_value(r.url(), APPLIED, {"outcome": "applied"}) >= target,
                f"{target} batches applied",
            )

    def ask(self, router: Proc, messages: list[dict[str, Any]]) -> tuple[int, int, str, str]:
        """(estimate, reused, source, route) of one chat request."""
        self.settle()
        hit0 = metric_value(self.decode.url(), HIT, {"source": "local_cache_hit"})
        raw = client(router).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8
        )
        answer = raw.parse().choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        hit1 = metric_value(self.decode.url(), HIT, {"source": "local_cache_hit"})
        cached, _, source = raw.headers["x-pd-cached-tokens"].partition("; source=")
        return int(cached), int(hit1 - hit0), source, raw.headers["x-pd-route"]


def words(n: int) -> str:
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"{tag}{i % 89}" for i in range(n))


def test_kv_events_estimate_equals_the_decoders_reuse_turn_by_turn(stack: Stack) -> None:
    s = Setup(stack, "kve")
    r = s.router("a")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": words(300)}]
    rows = []
    for _ in range(4):
        msgs.append({"role": "user", "content": words(60)})
        rows.append(s.ask(r, msgs))
    assert all(src == "events" for *_, src, _ in rows), rows
    assert all(est == reused for est, reused, _, _ in rows), rows
    assert rows[0][1] == 0 and all(reused > 0 for _, reused, _, _ in rows[1:]), rows
    # a replica started now learns both caches from the engines' replay buffers
    late = s.router("late")
    s.settle()
    msgs.append({"role": "user", "content": words(60)})
    est, reused, src, _ = s.ask(late, msgs)
    assert (src, est) == ("events", reused) and reused > 0


def test_kv_events_see_evictions_the_router_did_not_cause(stack: Stack) -> None:
    s = Setup(stack, "kvx", cache_tokens=1024)  # 64 blocks of 16
    r = s.router("a")
    first: list[dict[str, Any]] = [{"role": "user", "content": words(300)}]
    s.ask(r, first)
    again = [dict(m) for m in first[:1]]
    est, reused, _, _ = s.ask(r, again)
    assert est == reused > 0
    for _ in range(4):  # other prompts fill the cache: the first one's blocks are evicted
        s.ask(r, [{"role": "user", "content": words(300)}])
    est, reused, src, route = s.ask(r, [dict(m) for m in first[:1]])
    assert (src, est, reused) == ("events", 0, 0)
    assert route == "disaggregated"
