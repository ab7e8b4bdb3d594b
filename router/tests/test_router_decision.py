"""The decode-first decision end to end (issue 13): every reason reached by a real request
through the router on simulated vLLM engines (NIXL hand-off), said in ``x-pd-reason`` and
counted in ``pd_router_decisions_total``; two router replicas behaving as docs/router.md says."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack, free_port
from router_testlib import (
    MODEL,
    client,
    deep_merge,
    metric_value,
    set_fault,
    wait_until,
    write_config,
)

THRESHOLD = 256


class Setup:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.prefill = stack.sim("dc-prefill", "--kv-connector", "nixl")
        self.decoders = [stack.sim(f"dc-decode{i}", "--kv-connector", "nixl") for i in range(2)]
        self.a = self.router("dc-a")
        self.b = self.router("dc-b")  # a second replica: its own index
        self.length = self.router("dc-length", {"decision": "length"})
        for r in (self.a, self.b, self.length):
            wait_until(
                lambda r=r: metric_value(r.url(), "pd_router_healthy_endpoints") == 3,
                "every engine healthy",
            )

    def router(self, name: str, routing: dict[str, Any] | None = None, **over: Any) -> Proc:
        base: dict[str, Any] = {
            "routing": {"connector": "nixl", "threshold": THRESHOLD},
            "pools": {
                "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                "decode": {"discovery": "static", "static": [d.url() for d in self.decoders]},
            },
        }
        cfg = deep_merge(base, {"routing": routing or {}, **over})
        return self.stack.router(name, write_config(self.stack.workdir, name, cfg))


@pytest.fixture(scope="module")
def dc(stack: Stack) -> Setup:
    return Setup(stack)


def chat(router: Proc, text: str, **extra: Any) -> tuple[str, str]:
    """(x-pd-route, x-pd-reason) of a chat request through the official client."""
    raw = client(router).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3, **extra
    )
    assert raw.parse().choices[0].message.content is not None
    return raw.headers["x-pd-route"], raw.headers["x-pd-reason"]


def conversation(words: int = 600) -> str:
    """A long first turn no other test sends (its prefix is new to every index)."""
    tag = uuid.uuid4().hex
    return " ".join(f"{tag}{i % 97}" for i in range(words))


def decisions(router: Proc, route: str, reason: str) -> float:
    return metric_value(
        router.url(), "pd_router_decisions_total", {"route": route, "reason": reason}
    )


def test_short_long_and_the_next_turn(dc: Setup) -> None:
    before = decisions(dc.a, "direct", "prefix_cached")
    assert chat(dc.a, "Say hello.") == ("direct", "below_threshold")
    first = conversation()
    assert chat(dc.a, first) == ("disaggregated", "above_threshold")
    # the second turn repeats the first and adds a little: its decoder holds the rest
    assert chat(dc.a, first + " and then? " * 5) == ("direct", "prefix_cached")
    assert decisions(dc.a, "direct", "prefix_cached") == before + 1
    # a long new part still needs the prefiller
    assert chat(dc.a, first + conversation(400)) == ("disaggregated", "above_threshold")
    matched = metric_value(dc.a.url(), "pd_router_prefix_matched_tokens_count")
    assert matched >= 4


def test_the_decoder_that_got_the_kv_serves_the_next_turn_from_its_prefix_cache(
    dc: Setup,
) -> None:
    first = conversation()
    assert chat(dc.a, first)[0] == "disaggregated"
    hits = [metric_value(d.url(), "vllm:prefix_cache_hits_total") for d in dc.decoders]
    assert chat(dc.a, first + " more? " * 5) == ("direct", "prefix_cached")
    gained = [
        metric_value(d.url(), "vllm:prefix_cache_hits_total") - h
        for d, h in zip(dc.decoders, hits, strict=True)
    ]
    # one decoder served it from what the NIXL hand-off left in its cache
    assert sorted(g > 0 for g in gained) == [False, True], gained


def test_a_replica_that_never_saw_the_prefix_falls_back_to_the_length_rule(dc: Setup) -> None:
    first = conversation()
    assert chat(dc.a, first) == ("disaggregated", "above_threshold")
    nxt = first + " next turn " * 5
    assert chat(dc.b, nxt) == ("disaggregated", "above_threshold")
    assert chat(dc.a, nxt) == ("direct", "prefix_cached")
    # each replica now knows what it routed itself
    assert chat(dc.b, nxt + " again") == ("direct", "prefix_cached")


def test_session_affinity_puts_every_replicas_turns_on_one_decoder(dc: Setup, stack: Stack) -> None:
    header = "x-session-id"
    ra = dc.router("dc-aff-a", {"sessionAffinityHeader": header})
    rb = dc.router("dc-aff-b", {"sessionAffinityHeader": header})
    for r in (ra, rb):
        wait_until(lambda r=r: metric_value(r.url(), "pd_router_healthy_endpoints") == 3, "healthy")
    first = conversation()
    sid = {"extra_headers": {header: uuid.uuid4().hex}}
    assert chat(ra, first, **sid) == ("disaggregated", "above_threshold")
    # replica b sends the session to the same decoder but cannot know it holds the prefix
    assert chat(rb, first + " b? " * 5, **sid) == ("disaggregated", "above_threshold")
    assert chat(ra, first + " a? " * 5, **sid) == ("direct", "prefix_cached")


def test_length_mode_disaggregates_every_long_prompt(dc: Setup) -> None:
    first = conversation()
    for text in (first, first + " and then? " * 5):
        assert chat(dc.length, text) == ("disaggregated", "above_threshold")


def test_a_busy_prefill_pool_is_bypassed(dc: Setup) -> None:
    r = dc.router(
        "dc-busy",
        {"prefillBusy": {"queuedTokens": 1}},
        timeouts={"prefillSeconds": 2},
    )
    wait_until(lambda: metric_value(r.url(), "pd_router_healthy_endpoints") == 3, "healthy")
    set_fault(dc.prefill, "hang", count=1)
    held: dict[str, tuple[str, str]] = {}
    t = threading.Thread(target=lambda: held.update(first=chat(r, conversation())))
    t.start()
    wait_until(
        lambda: metric_value(r.url(), "pd_router_outstanding", {"pool": "prefill"}) == 1,
        "the first long prompt held by the prefiller",
    )
    # every prefiller busy (one, holding a prompt), the decoder idle: served directly
    assert chat(r, conversation()) == ("direct", "prefill_busy")
    t.join(timeout=60)
    assert held["first"] == ("fallback", "prefill_timeout")
    assert decisions(r, "direct", "prefill_busy") == 1
    assert decisions(r, "fallback", "prefill_timeout") == 1


def test_no_prefiller_threshold_zero_and_batches_say_why(dc: Setup) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    alone = dc.router("dc-alone", pools={"prefill": {"static": [dead]}})
    always = dc.router("dc-always", {"threshold": 0})
    for router, healthy in ((alone, 2), (always, 3)):
        wait_until(
            lambda r=router, n=healthy: metric_value(r.url(), "pd_router_healthy_endpoints") == n,
            "the live engines healthy",
        )
    assert chat(alone, conversation()) == ("fallback", "no_prefiller")
    assert chat(always, "hi") == ("disaggregated", "always")
    assert chat(dc.a, "hi", n=2) == ("direct", "batch")
