"""The hand-off legs the router builds (pd_router.handoff.lmcache and .nixl), validated by the
real vLLM request models of each version the chart is checked against: accepted, with
``kv_transfer_params`` where the KV connector reads it (``SamplingParams.extra_args``), the
one-token prefill, and ``return_token_ids`` on the LMCache prefill leg that learns the prompt's
ids from the prefiller (issue 15). The simulator answers these fields as vLLM does
(router/tests); this holds the requests themselves to vLLM."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from pd_router.handoff import lmcache, nixl

from tests.engines import stack

pytestmark = pytest.mark.xdist_group("engine-vllm-requests")

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "min_tokens": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
}
COMPLETION = {"model": "m", "prompt": "hi there", "max_tokens": 8, "stream": False}
IDS = [11, 12, 13, 14]
PORTS = ([7300, 7301], [7400, 7401])


def _cases() -> list[dict[str, Any]]:
    kv = nixl.decode_params(
        {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "remote_engine_id": "e",
                "remote_block_ids": [[0]],
                "remote_host": "h",
                "remote_port": 5600,
            }
        }
    )
    return [
        {
            "name": "lmcache prefill, chat, ids from the answer",
            "chat": True,
            "body": lmcache.prefill_body(CHAT, None, "r-1", "10.0.0.2", *PORTS),
        },
        {
            "name": "lmcache prefill, completion text, ids from the answer",
            "chat": False,
            "body": lmcache.prefill_body(COMPLETION, None, "r-2", "10.0.0.2", *PORTS),
        },
        {
            "name": "lmcache prefill, token ids",
            "chat": False,
            "body": lmcache.prefill_body(CHAT, IDS, "r-3", "10.0.0.2", *PORTS),
        },
        {"name": "lmcache decode", "chat": False, "body": lmcache.decode_body(CHAT, IDS, 99, 8, True)},
        {"name": "nixl prefill, chat", "chat": True, "body": nixl.prefill_body(CHAT)},
        {"name": "nixl decode, chat", "chat": True, "body": nixl.decode_body(CHAT, kv or {})},
        # the negative controls: bodies vLLM must refuse, or this test proves nothing. vLLM's
        # request models accept unknown fields, so each is a value of a known one: a wrong type,
        # and rules vLLM checks past the types (its model validators, SamplingParams)
        {"name": "BAD max_tokens", "chat": False, "body": {**COMPLETION, "max_tokens": "eight"}},
        {"name": "BAD kv_transfer_params", "chat": True, "body": {**CHAT, "kv_transfer_params": "pull"}},
        {"name": "BAD min_tokens", "chat": False, "body": {**COMPLETION, "max_tokens": 2, "min_tokens": 5}},
        {"name": "BAD stream_options", "chat": True, "body": {**CHAT, "stream": False}},
        {"name": "BAD top_p", "chat": False, "body": {**COMPLETION, "top_p": 2}},
    ]


@functools.cache
def results(version: str) -> dict[str, dict[str, Any]]:
    out = stack.run("vllm_requests.py", {"cases": _cases()}, vllm=version)
    assert out["version"] == version
    return {r["name"]: r for r in out["results"]}


@pytest.mark.parametrize("version", stack.VLLM_VERSIONS)
def test_every_leg_is_a_request_vllm_accepts(version: str) -> None:
    res = results(version)
    bad = {n: r["error"] for n, r in res.items() if "error" in r and not n.startswith("BAD")}
    assert not bad, bad
    refused = {n for n, r in res.items() if n.startswith("BAD") and "error" in r}
    assert refused == {n for n in res if n.startswith("BAD")}, {n: r for n, r in res.items() if n.startswith("BAD")}


@pytest.mark.parametrize("version", stack.VLLM_VERSIONS)
def test_the_lmcache_prefill_leg_reaches_the_connector_and_asks_for_the_ids(version: str) -> None:
    res = results(version)
    for name in ("lmcache prefill, chat, ids from the answer", "lmcache prefill, completion text, ids from the answer"):
        r = res[name]
        assert r["return_token_ids"] and r["max_tokens"] == 1 and not r["stream"], r
        spec = r["kv_transfer_params"]["disagg_spec"]
        assert r["kv_transfer_params"]["ret_first_tok"] and spec["receiver_init_port"] == PORTS[0]
    assert res["lmcache prefill, chat, ids from the answer"]["min_tokens"] == 1  # lowered to the one token
    ids_leg = res["lmcache prefill, token ids"]
    assert not ids_leg["return_token_ids"] and ids_leg["kv_transfer_params"]["disagg_spec"]["req_id"] == "r-3"
    decode = res["lmcache decode"]
    assert decode["kv_transfer_params"] is None and decode["max_tokens"] == 7 and decode["min_tokens"] == 1


@pytest.mark.parametrize("version", stack.VLLM_VERSIONS)
def test_the_nixl_legs_carry_their_kv_transfer_params(version: str) -> None:
    res = results(version)
    pre, dec = res["nixl prefill, chat"], res["nixl decode, chat"]
    assert pre["kv_transfer_params"]["do_remote_decode"] is True and not pre["stream"]
    assert dec["kv_transfer_params"]["do_remote_prefill"] is True and dec["stream"]
