"""Churn on the real engines (issue 36): an engine stopped (SIGSTOP) for longer than the router's
deadlines, then resumed. The router finds the stall (``health.stallSeconds``, the chart's 5 s,
then a failed ``/health`` within 2 s), ejects the engine and ends what waited on it at once: a
prompt whose prefiller stopped is served whole with the right answer, a stream whose decoder
stopped ends with an OpenAI error event. Resumed, the engine is re-admitted and the next long
prompt is disaggregated again, equal to colocated. The router's own deadlines (prefillSeconds
300, streamIdleSeconds 120) and the client's (60 s) are far longer than the watch: without it
each test here fails on the client's timeout. Seconds from the fault to the answer or error
are printed (``-s``) for docs/testing.md, never asserted."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import openai
import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers

CLIENT_SECONDS = 60


@pytest.fixture(scope="module")
def router(pd: dict[str, engines.Engine], routers: Routers) -> Proc:
    """The chart's dev router in front of the dense pair, ejecting a stalled engine for 1 s (the
    chart's 30 s would only make the tests wait for the re-admission)."""
    return routers.start([pd["prefill"].url], [pd["decode"].url], env={"PD_ROUTER__HEALTH__EJECTIONSECONDS": "1"})


def metric(router: Proc, name: str, **labels: str) -> float:
    return engines.value(engines.metrics_text(router.url()), name, **labels)


def back(router: Proc, pool: str) -> None:
    """Until the router has the pool's engine back (its checks re-admit it after the ejection)."""
    deadline = time.monotonic() + 60
    while metric(router, "pd_router_healthy_endpoints", pool=pool) < 1:
        assert time.monotonic() < deadline, f"the resumed {pool} engine was never re-admitted"
        time.sleep(0.1)


@pytest.fixture
def resumed(pd: dict[str, engines.Engine]) -> Iterator[None]:
    """Whatever a test stopped runs again after it."""
    yield
    for e in pd.values():
        e.signal(signal.SIGCONT)


def test_churn_a_prefiller_stopped_then_resumed(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, resumed: None
) -> None:
    prompt = text("churn-prefiller-stopped", LONG_WORDS)
    base = colocated(pd["decode"].url, model_name, True, prompt)
    stalls = metric(router, "pd_router_engine_stalls_total", pool="prefill")
    pd["prefill"].signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        got = ask(router.url(), model_name, True, prompt, False)
    finally:
        pd["prefill"].signal(signal.SIGCONT)
    print(f"churn: prefiller stopped: the right answer, served whole, {time.monotonic() - t0:.1f} s after the stop")
    assert (got.route, got.reason) == ("fallback", "prefill_timeout")
    assert got.text == base.text
    assert metric(router, "pd_router_engine_stalls_total", pool="prefill") == stalls + 1
    t1 = time.monotonic()
    back(router, "prefill")
    again = ask(router.url(), model_name, True, text("churn-prefiller-back", LONG_WORDS), False)
    print(f"churn: prefiller resumed: disaggregated again {time.monotonic() - t1:.1f} s after the resume")
    assert again.route == "disaggregated"
    assert again.text == colocated(pd["decode"].url, model_name, True, text("churn-prefiller-back", LONG_WORDS)).text


STREAM_TOKENS = 1500  # about 15 s of decoding: the fault always comes mid-stream


def stream_with_a_fault(router: Proc, model_name: str, tag: str, fault: Callable[[], None]) -> tuple[float, int]:
    """A long stream through the router with ``fault()`` done at its first token; it must end with
    the router's error event, not the client giving up. Returns (seconds from the fault to that
    event, chunks read)."""
    c = openai.OpenAI(base_url=router.url() + "/v1", api_key="none", max_retries=0, timeout=CLIENT_SECONDS)
    pieces = 0
    t0 = 0.0
    with pytest.raises(openai.APIError) as caught:  # noqa: PT012 - the fault comes mid-stream
        stream = c.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": text(tag, 20)}],
            max_tokens=STREAM_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        for chunk in stream:
            pieces += 1
            if chunk.choices and chunk.choices[0].delta.content and not t0:
                fault()
                t0 = time.monotonic()
    took = time.monotonic() - t0
    assert not isinstance(caught.value, openai.APIConnectionError), caught.value
    assert t0 and pieces < STREAM_TOKENS
    return took, pieces


def test_churn_a_decoder_stopped_mid_stream_then_resumed(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, resumed: None
) -> None:
    stalls = metric(router, "pd_router_engine_stalls_total", pool="decode")
    try:
        took, _ = stream_with_a_fault(
            router, model_name, "churn-decoder-stopped", lambda: pd["decode"].signal(signal.SIGSTOP)
        )
    finally:
        pd["decode"].signal(signal.SIGCONT)
    print(f"churn: decoder stopped mid-stream: an error event {took:.1f} s after the stop")
    assert metric(router, "pd_router_engine_stalls_total", pool="decode") == stalls + 1
    t1 = time.monotonic()
    back(router, "decode")
    prompt = text("churn-decoder-back", LONG_WORDS)
    again = ask(router.url(), model_name, True, prompt, False)
    print(f"churn: decoder resumed: disaggregated again {time.monotonic() - t1:.1f} s after the resume")
    assert again.route == "disaggregated"
    assert again.text == colocated(pd["decode"].url, model_name, True, prompt).text


def disaggregated_again(router: Proc, pd: dict[str, engines.Engine], model_name: str, tag: str) -> float:
    """Seconds until a long prompt is disaggregated again with the colocated answer; every answer
    meanwhile (served whole as a fallback while a pair is not back) must be the right one."""
    t0 = time.monotonic()
    back(router, "prefill")
    back(router, "decode")
    for i in range(20):  # (its revision learnt at the check that admits it: a fallback or two)
        prompt = text(f"{tag}-{i}", LONG_WORDS)
        got = ask(router.url(), model_name, True, prompt, False)
        assert got.text == colocated(pd["decode"].url, model_name, True, prompt).text, (got.route, got.reason)
        if got.route == "disaggregated":
            return time.monotonic() - t0
    raise AssertionError(f"{tag}: never disaggregated again")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_churn_an_engine_restarted_on_its_address(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, role: str
) -> None:
    """The engine is replaced by a new one (a new NIXL engine id) on the same address while the
    other still holds the old one's handshake (vLLM issue 49238: a prefiller restart segfaulted
    the decoder; SGLang's gateway issue 2503 the reverse): the other engine lives on, and the
    next long prompts are disaggregated again with the right answers."""
    warm = text(f"churn-{role}-restart-warm", LONG_WORDS)
    assert ask(router.url(), model_name, True, warm, False).route == "disaggregated"  # a handshake held
    other = pd["decode" if role == "prefill" else "prefill"]
    pd[role].restart()
    engines.wait_ready([pd[role]])
    took = disaggregated_again(router, pd, model_name, f"churn-{role}-restarted")
    print(f"churn: {role} restarted on its address: disaggregated again {took:.1f} s after it was ready")
    assert other.popen is not None and other.popen.poll() is None, other.log_tail()


def test_churn_a_decoder_killed_mid_stream(router: Proc, pd: dict[str, engines.Engine], model_name: str) -> None:
    """SIGKILL mid-stream: the stream ends with the router's error event (the decoder is the only
    one), the prefiller lives on; a new decoder on the same address serves again."""
    took, _ = stream_with_a_fault(
        router, model_name, "churn-decoder-killed", lambda: pd["decode"].signal(signal.SIGKILL)
    )
    print(f"churn: decoder killed mid-stream: an error event {took:.1f} s after the kill")
    pre = pd["prefill"]
    assert pre.popen is not None and pre.popen.poll() is None, pre.log_tail()
    pd["decode"].restart()
    engines.wait_ready([pd["decode"]])
    took = disaggregated_again(router, pd, model_name, "churn-decoder-killed-back")
    print(f"churn: decoder replaced: disaggregated again {took:.1f} s after it was ready")
