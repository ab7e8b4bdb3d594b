"""``make bench``'s Go engine answers in the Python simulator's shapes (the same keys in the
same order, vLLM 0.31's), for every answer a router reads, and its load generator counts what
it sends. Skipped where no Go toolchain is installed (the binary is built on first use).

Not in the repository's pytest ``testpaths``: run ``pytest router/dev/tests``.
"""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from pd_router.handoff.nixl import PREFILL_PARAMS
from pd_router_dev import fastengine
from pd_router_dev.devstack import Proc, Stack

pytestmark = pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain")

MODEL = "llama-3.3-70b"
NIXL_PREFILL = PREFILL_PARAMS  # what the router's NIXL route sends
LMCACHE_PREFILL = {
    "ret_first_tok": True,
    "disagg_spec": {
        "req_id": "r-1",
        "receiver_host": "127.0.0.1",
        "receiver_init_port": [1],
        "receiver_alloc_port": [2],
    },
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, int, Proc]]:
    st = Stack(tmp_path_factory.mktemp("fastengine"))
    try:
        # a NIXL simulator answers do_remote_decode; the LMCache sender answers ret_first_tok
        # (its KV push and notification fail here, after the answer: nothing listens)
        sim = st.sim("fe-sim", "--kv-connector", "nixl")
        lm = st.sim("fe-sim-lm", "--kv-connector", "lmcache", "--pd-proxy-port", "1")
        fe, _, sidecar = fastengine.start_engine(st.workdir, "fe", 1, True, None)
        st.adopt(fe)
        yield sim, fe, sidecar, lm
    finally:
        st.stop()


def call(port: int, path: str, body: Any = None, method: str = "POST") -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        c.request(method, path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def shape(v: Any) -> Any:
    """The keys (in order) and types of a JSON value, not its values."""
    if isinstance(v, dict):
        return [(k, shape(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [shape(x) for x in v[:1]]
    return type(v).__name__ if v is not None else None


def events(raw: bytes) -> list[Any]:
    out = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: "):
            p = ev[6:]
            out.append(p.decode() if p == b"[DONE]" else json.loads(p))
    return out


def body(chat: bool, stream: bool, **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "ignore_eos": True, "stream": stream}
    if chat:
        b["messages"] = [{"role": "user", "content": "hello there, engine"}]
    else:
        b["prompt"] = "hello there, engine"
    b.update(extra)
    return b


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("stream", "usage"),
    [(False, False), (True, False), (True, True)],  # stream_options needs a stream
    ids=["json", "sse", "sse-usage"],
)
def test_answers_have_the_simulators_shape(
    engines: Any, chat: bool, stream: bool, usage: bool
) -> None:
    sim, fe, _, _ = engines
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    got = [call(p.port, path, body(chat, stream, **extra)) for p in (sim, fe)]
    assert [s for s, _ in got] == [200, 200]
    if stream:
        a, b = (events(raw) for _, raw in got)
        assert [shape(e) for e in a] == [shape(e) for e in b]
        assert a[-1] == b[-1] == "[DONE]"
    else:
        a, b = (json.loads(raw) for _, raw in got)
        assert shape(a) == shape(b)
        assert a["usage"] == b["usage"]  # the same toy tokenizer counts the prompt


def test_nixl_prefill_answer(engines: Any) -> None:
    sim, fe, _, _ = engines
    b = body(True, False, max_tokens=1, kv_transfer_params=NIXL_PREFILL)
    a, f = (json.loads(call(p.port, "/v1/chat/completions", b)[1]) for p in (sim, fe))
    assert shape(a) == shape(f)
    assert a["kv_transfer_params"].keys() == f["kv_transfer_params"].keys()
    assert (
        f["kv_transfer_params"]["remote_num_tokens"] == a["kv_transfer_params"]["remote_num_tokens"]
    )


def test_lmcache_prefill_answer(engines: Any) -> None:
    _, fe, _, lm = engines
    b = {
        "model": MODEL,
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "kv_transfer_params": LMCACHE_PREFILL,
    }
    a, f = (json.loads(call(p.port, "/v1/completions", b)[1]) for p in (lm, fe))
    assert shape(a) == shape(f)
    assert type(f["kv_transfer_params"]["first_tok"]) is int
    assert f["usage"]["completion_tokens"] == 1


def test_tokenize_sidecar_and_simple_routes(engines: Any) -> None:
    sim, fe, sidecar, _ = engines
    for req in (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi there, you"}]},
        {"model": MODEL, "prompt": "hi there, you"},
    ):
        a, f = (json.loads(call(p.port, "/tokenize", req)[1]) for p in (sim, fe))
        assert a == f  # the same ids: the simulator's toy tokenizer
    assert call(fe.port, "/health", method="GET")[0] == 200
    assert json.loads(call(fe.port, "/v1/models", method="GET")[1])["data"][0]["id"] == MODEL
    assert b"vllm:num_requests_running" in call(fe.port, "/metrics", method="GET")[1]
    status, raw = call(sidecar, "/v1/notifications/r%2D1?count=2&timeout=5", method="GET")
    assert status == 200 and json.loads(raw)["received"] == 2


def test_per_token_writes_and_the_load_generator(engines: Any) -> None:
    _, fe, _, _ = engines
    assert call(fe.port, "/fastengine/flush", b"token")[0] == 200
    try:
        raw = call(fe.port, "/v1/chat/completions", body(True, True))[1]
        assert events(raw)[-1] == "[DONE]"
        b = json.dumps(body(True, True)).encode()
        p = fastengine.run_load(
            f"http://127.0.0.1:{fe.port}/v1/chat/completions", b, 4, 0.5, 0.1, True, None
        )
        res = fastengine.load_result(p, 30)
    finally:
        call(fe.port, "/fastengine/flush", b"request")
    assert res["errors_all"] == 0 and res["requests"] > 0
    assert res["ttft_p50_ms"] is not None and res["p50_ms"] >= res["ttft_p50_ms"]
