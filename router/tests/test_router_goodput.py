"""The flexible layout and the goodput decision end to end on simulated engines (the real
engine's turn is tests/real_engine/test_real_flex.py): the pool's engines in both roles, never
one engine for both legs of a hand-off, each decision explained (x-pd-reason, x-pd-predicted,
the access line's engines) and its TTFT prediction's error exported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from pd_router_dev.devstack import Proc, Stack
from router_testlib import (
    MODEL,
    client,
    http_call,
    long_text,
    metric_value,
    set_fault,
    wait_until,
    write_config,
)


class Flex:
    """Two simulated engines that take either part (the sim's NIXL handles both per request)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.engines = [
            stack.sim(f"fx-{i}", "--kv-connector", "nixl", "--engine-id", f"fx-{i}")
            for i in range(2)
        ]

    def router(self, name: str, routing: dict[str, Any]) -> Proc:
        cfg: dict[str, Any] = {
            "routing": {"connector": "nixl", "sessionAffinityHeader": "", **routing},
            "pools": {
                "layout": "flexible",
                "decode": {"discovery": "static", "static": [e.url() for e in self.engines]},
            },
            "logging": {"level": "info"},
            "timeouts": {"prefillSeconds": 3, "firstByteSeconds": 3, "streamIdleSeconds": 5},
        }
        path = write_config(self.stack.workdir, name, cfg)
        data = yaml.safe_load(path.read_text())
        data["pools"].pop("prefill", None)  # the demo config's: refused in a flexible layout
        path.write_text(yaml.safe_dump(data))
        return self.stack.router(name, path)

    def requests(self, i: int) -> list[dict[str, Any]]:
        _, _, body = http_call(self.engines[i].url() + "/sim/requests")
        return json.loads(body)


@pytest.fixture(scope="module")
def fx(stack: Stack) -> Iterator[Flex]:
    yield Flex(stack)


@pytest.fixture(autouse=True)
def _reset(fx: Flex) -> Iterator[None]:
    yield
    for e in fx.engines:
        set_fault(e, "none")


def _access_lines(router: Proc, *rids: str) -> dict[str, dict[str, Any]]:
    """The router's access lines by request id, once those of ``rids`` are written (a line is
    written when its request ends in the router, which may be after the client read the last
    byte)."""
    out: dict[str, dict[str, Any]] = {}

    def read() -> bool:
        for line in router.log.read_text().splitlines():
            if '"msg":"request"' in line:
                rec = json.loads(line)
                out[rec["request_id"]] = rec
        return all(r in out for r in rids)

    wait_until(read, f"the access lines of {', '.join(rids)}")
    return out


def test_a_split_in_a_flexible_pool_uses_two_engines_and_never_hands_one_its_own_kv(
    fx: Flex,
) -> None:
    """Threshold 0 splits every prompt; each engine decodes with the other's KV only. When the
    decoder then fails to load the KV, the one engine left is the prefiller itself: it gets
    the prompt without the hand-off (recomputed there), never its own kv_transfer_params."""
    router = fx.router("fx-always", {"decision": "prefix", "threshold": 0})
    c = client(router)
    for i in range(6):
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"q{i} " + long_text(50)}],
            max_tokens=5,
            extra_headers={"X-Request-Id": f"split-{i}"},
        )
        assert raw.headers["x-pd-route"] == "disaggregated"
    lines = _access_lines(router, *(f"split-{i}" for i in range(6)))
    for i in range(6):
        rec = lines[f"split-{i}"]
        assert rec["engine"] and rec["prefiller"] and rec["engine"] != rec["prefiller"], rec
    for e in fx.engines:
        set_fault(e, "kv_load_fail")
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "last " + long_text(50)}],
        max_tokens=5,
        extra_headers={"X-Request-Id": "own-kv"},
    )
    assert (raw.headers["x-pd-route"], raw.headers["x-pd-reason"]) == ("fallback", "decode_retry")
    assert raw.parse().choices[0].message.content
    rec = _access_lines(router, "own-kv")["own-kv"]
    assert rec["engine"] == rec["prefiller"]  # the prefiller served it in the end...
    for i in range(len(fx.engines)):  # ...never with its own KV to pull
        for r in fx.requests(i):
            kv = r["body"].get("kv_transfer_params") or {}
            if kv.get("do_remote_prefill"):
                assert kv.get("remote_engine_id") != f"fx-{i}", r
    # negative control: the failing decoder did get a hand-off to pull, from the other engine
    pulls = [
        r["body"]["kv_transfer_params"]
        for i in range(2)
        for r in fx.requests(i)
        if r["x_request_id"] == "own-kv"
        and (r["body"].get("kv_transfer_params") or {}).get("do_remote_prefill")
    ]
    assert len(pulls) == 1


def test_the_goodput_decision_explains_itself_and_exports_its_error(fx: Flex) -> None:
    router = fx.router("fx-goodput", {"decision": "goodput"})
    c = client(router)
    with c.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=8,
        stream=True,
        extra_headers={"X-Request-Id": "gp-short"},
    ) as r:
        assert r.headers["x-pd-route"] == "direct"
        assert r.headers["x-pd-reason"] in ("handoff_not_worth", "whole_best", "one_engine_enough")
        predicted = dict(p.strip().split("=") for p in r.headers["x-pd-predicted"].split(";"))
        assert set(predicted) == {"ttft_ms", "itl_ms", "misses", "held_up"}
        assert float(predicted["ttft_ms"]) > 0
        assert 0 <= float(predicted["held_up"]) <= float(predicted["misses"])
        assert list(r.iter_lines())
    rec = _access_lines(router, "gp-short")["gp-short"]
    assert rec["engine"] in {e.url() for e in fx.engines} and rec["prefiller"] == ""
    n = metric_value(router.url(), "pd_router_ttft_prediction_ratio_count", {"route": "direct"})
    assert n == 1
    assert (
        metric_value(
            router.url(), "pd_router_decisions_total", {"route": "direct", "reason": rec["reason"]}
        )
        == 1
    )
    # negative control: a decision that predicts nothing says nothing
    other = fx.router("fx-prefix", {"decision": "prefix", "threshold": 100000})
    raw = client(other).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8
    )
    assert "x-pd-predicted" not in raw.headers
