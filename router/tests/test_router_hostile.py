"""Property-based: malformed and hostile bodies never produce a 5xx and never hang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_router.devstack import Proc, Stack
from router_testlib import LMCacheStack, http_call, write_config

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "model",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "temperature",
        "top_p",
        "stream_options",
        "kv_transfer_params",
        "vllm_xargs",
        "logprobs",
        "tools",
        "ignore_eos",
        "seed",
        "prompt",
        "messages",
        "echo",
        "response_format",
    ]
)
messages = st.one_of(
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_values)},
            optional={"content": st.one_of(st.text(max_size=200), json_values)},
        ),
        max_size=3,
    ),
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(
        lambda base, extra: json.dumps({**base, **extra}).encode(),
        st.fixed_dictionaries(
            {"messages": messages},
            optional={"prompt": st.one_of(st.text(max_size=300), json_values)},
        ),
        st.dictionaries(fields, json_values, max_size=4),
    ),
    st.builds(  # valid-looking long prompts that cross the threshold with odd options
        lambda words, extra: json.dumps(
            {
                "messages": [{"role": "user", "content": " ".join(["w"] * words)}],
                "max_tokens": 3,
                **extra,
            }
        ).encode(),
        st.integers(1, 400),
        st.dictionaries(fields.filter(lambda f: f not in ("messages",)), json_values, max_size=2),
    ),
)


# header values as raw bytes, not necessarily UTF-8: whatever RFC 9110 allows in a field value
# (VCHAR, obs-text, space, tab); control characters are refused by the HTTP parser itself
header_values = st.binary(max_size=60).filter(
    lambda v: all((b >= 32 and b != 127) or b == 9 for b in v)
)
hostile_headers = st.dictionaries(
    st.sampled_from(["X-Request-Id", "x-session-id", "Authorization", "Content-Encoding"]),
    header_values,
    max_size=3,
)


@pytest.fixture(scope="module")
def routers(stack: Stack) -> Iterator[list[Proc]]:
    with pytest.MonkeyPatch.context() as mp:
        # The simulated engines serve n > 1 like vLLM, up to VLLM_MAX_N_SEQUENCES (vLLM's own
        # knob, 16384 by default): a drawn n of thousands with ignore_eos would take minutes.
        mp.setenv("VLLM_MAX_N_SEQUENCES", "16")
        yield from _routers(stack)


def _routers(stack: Stack) -> Iterator[list[Proc]]:
    lm = LMCacheStack(stack)
    lm_router = lm.router(
        "hb-lm",
        {"routing": {"connector": "lmcache", "threshold": 64}, "limits": {"maxBodyBytes": 100000}},
    )
    pre = stack.sim("hb-nx-prefill", "--kv-connector", "nixl")
    dec = stack.sim("hb-nx-decode", "--kv-connector", "nixl")
    cfg = {
        "routing": {"connector": "nixl", "threshold": 64},
        "pools": {
            "prefill": {"discovery": "static", "static": [pre.url()]},
            "decode": {"discovery": "static", "static": [dec.url()]},
        },
    }
    nx_router = stack.router("hb-nx", write_config(stack.workdir, "hb-nx", cfg))
    yield [lm_router, nx_router]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=bodies,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    which=st.integers(0, 1),
    headers=hostile_headers,
)
def test_hostile_bodies(
    routers: list[Proc], body: bytes, path: str, which: int, headers: dict[str, bytes]
) -> None:
    router = routers[which]
    hdrs: dict[str, Any] = {**headers, "Content-Type": "application/json"}
    status, _, data = http_call(router.url() + path, "POST", body, hdrs, timeout=30)
    assert status < 500, (status, body[:200], data[:300])
    if status >= 400:
        err = json.loads(data)
        assert set(err["error"]) == {"message", "type", "param", "code"}
