"""Churn on the real engines (issue 36): engines killed (SIGKILL) mid-stream, with a hand-off
pending and mid-transfer, then replaced; and an engine stopped (SIGSTOP) for longer than the
router's deadlines, then resumed. The router finds the stall (``health.stallSeconds``, the chart's 5 s,
then a failed ``/health`` within 2 s), ejects the engine and ends what waited on it at once: a
prompt whose prefiller stopped is served whole with the right answer, a stream whose decoder
stopped ends with an OpenAI error event. Resumed, the engine is re-admitted and the next long
prompt is disaggregated again, equal to colocated. The router's own deadlines (prefillSeconds
300, streamIdleSeconds 120) and the client's (60 s) are far longer than the watch: without it
each test here fails on the client's timeout.

Every fault comes under running load (tests/real_engine/load.py): two clients asking all the
while, long and short prompts, streamed and not, each prompt new (so long ones are
disaggregated, not served from the decoder's prefix cache). Each of those requests must end with
the answer the decoder gives for it alone (asked once the pair is back) or with an OpenAI-shaped
error (a status the client parses, or the router's error event mid-stream): never a wrong
answer, a dropped connection or the client's timeout. Once a long prompt is disaggregated again,
the next long prompts of the load must all be (the share back to 100 %). Seconds from the fault
to the answer or error, and the longest a loaded request took to end after it, are printed
(``-s``) for docs/testing.md, never asserted.

An engine killed is replaced on its address, as a StatefulSet's pod is: a new NIXL engine id
where the other engine holds the old one's handshake (a hand-off of the load came first). That
is also what a rolling restart does, so no test restarts an engine apart from a fault."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.load import CLIENT_SECONDS, Load, back, disaggregated_again, metric, running, until
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers


@pytest.fixture
def load(router: Proc, model_name: str, request: pytest.FixtureRequest) -> Iterator[Load]:
    with running(router, model_name, request.node.name) as ld:
        yield ld


@pytest.fixture(scope="module")
def router(pd: dict[str, engines.Engine], routers: Routers) -> Proc:
    """The chart's dev router in front of the dense pair, ejecting a stalled engine for 1 s (the
    chart's 30 s would only make the tests wait for the re-admission)."""
    return routers.start([pd["prefill"].url], [pd["decode"].url], env={"PD_ROUTER__HEALTH__EJECTIONSECONDS": "1"})


@pytest.fixture
def resumed(pd: dict[str, engines.Engine]) -> Iterator[None]:
    """Whatever a test stopped runs again after it."""
    yield
    for e in pd.values():
        e.signal(signal.SIGCONT)


def test_churn_a_prefiller_stopped_then_resumed(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, resumed: None, load: Load
) -> None:
    prompt = text("churn-prefiller-stopped", LONG_WORDS)
    base = colocated(pd["decode"].url, model_name, True, prompt)
    stalls = metric(router, "pd_router_engine_stalls_total", pool="prefill")
    pd["prefill"].signal(signal.SIGSTOP)
    load.fault()
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
    print(f"churn: prefiller resumed: {load.settle(time.monotonic())}")
    print(f"churn: prefiller stopped, {load.check(pd['decode'].url)}")


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
    router: Proc, pd: dict[str, engines.Engine], model_name: str, resumed: None, load: Load
) -> None:
    stalls = metric(router, "pd_router_engine_stalls_total", pool="decode")

    def stop() -> None:
        pd["decode"].signal(signal.SIGSTOP)
        load.fault()

    try:
        took, _ = stream_with_a_fault(router, model_name, "churn-decoder-stopped", stop)
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
    print(f"churn: decoder resumed: {load.settle(time.monotonic())}")
    print(f"churn: decoder stopped, {load.check(pd['decode'].url)}")


def test_churn_a_decoder_killed_mid_stream(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, load: Load
) -> None:
    """SIGKILL mid-stream: the stream ends with the router's error event (the decoder is the only
    one), the prefiller lives on; a new decoder on the same address serves again."""

    def kill() -> None:
        pd["decode"].signal(signal.SIGKILL)
        load.fault()

    until("a hand-off of the load: a handshake held", lambda: load.handshakes_before_fault() > 0)
    took, _ = stream_with_a_fault(router, model_name, "churn-decoder-killed", kill)
    print(f"churn: decoder killed mid-stream: an error event {took:.1f} s after the kill")
    replace_the_killed_decoder(router, pd, model_name, load, "churn-decoder-killed")


def replace_the_killed_decoder(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, load: Load, tag: str
) -> None:
    """The prefiller lived on; a new decoder on the address (a new NIXL engine id where the
    prefiller met the old one: SGLang's gateway issue 2503 saw the prefiller segfault) is paired
    again; the load's checks."""
    pre = pd["prefill"]
    assert pre.popen is not None and pre.popen.poll() is None, pre.log_tail()
    pd["decode"].restart()
    engines.wait_ready([pd["decode"]])
    took = disaggregated_again(router, pd["decode"].url, model_name, f"{tag}-back")
    print(f"churn: decoder replaced: disaggregated again {took:.1f} s after it was ready")
    print(f"churn: decoder replaced: {load.settle(time.monotonic())}")
    print(f"churn: {tag}, {load.check(pd['decode'].url)}")


def prefills(e: engines.Engine) -> float:
    """Requests the engine has finished (a prefill leg finishes at its one token)."""
    return engines.value(e.metrics(), "vllm:request_success_total")


def test_churn_a_decoder_killed_with_a_hand_off_pending(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, resumed: None, load: Load
) -> None:
    """The decoder is stopped as a long prompt is sent and killed (SIGKILL) once the prefiller has
    answered a prefill leg: the decode leg went to a decoder that never pulled the KV the
    prefiller holds for it (vLLM 0.31.0 frees those blocks when their lease expires:
    ``kv_lease_duration`` in the connector's extra config, 30 s by default,
    ``nixl/base_worker.py``). The client gets an OpenAI error (no other decoder), the prefiller
    lives on, and a new decoder on the address is paired again."""
    # token ids, not text: the router would ask an engine's /tokenize for a text's count, and
    # that may be the decoder held still (then ejected by the stall watch: no pair to prefill for)
    status, tokenized, _ = engines.post(
        pd["decode"].url, "/tokenize", {"model": model_name, "prompt": text("churn-handoff-pending", LONG_WORDS)}
    )
    assert status == 200, tokenized
    prompt = tokenized["tokens"]
    until("a hand-off of the load: a handshake held", lambda: load.handshakes_before_fault() > 0)
    with ThreadPoolExecutor(1) as pool:
        with load.short_only():  # until the kill, the prefiller's one prefill leg is this prompt's
            before = prefills(pd["prefill"])
            pd["decode"].signal(signal.SIGSTOP)
            load.fault()
            asked = pool.submit(ask, router.url(), model_name, False, prompt, False)
            until("the prefiller answers its prefill leg", lambda: prefills(pd["prefill"]) > before)
            pd["decode"].signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as caught:
            asked.result(timeout=2 * CLIENT_SECONDS)
    took = time.monotonic() - t0
    assert not isinstance(caught.value, openai.APIConnectionError), caught.value
    print(f"churn: decoder killed with a hand-off pending: an OpenAI error {took:.1f} s after the kill")
    replace_the_killed_decoder(router, pd, model_name, load, "churn-handoff-pending")


def test_churn_a_prefiller_killed_mid_transfer(
    router: Proc, pd: dict[str, engines.Engine], model_name: str, resumed: None, load: Load
) -> None:
    """SIGKILL to the prefiller once it has answered a long prompt's prefill leg, the decoder
    held still (SIGSTOP) meanwhile so that its pull of that KV comes after the kill (on loopback
    a pull takes milliseconds: a kill timed from outside lands after it), then let go before the
    router's stall watch (5 s) would eject it. The decoder's pull from the dead prefiller fails, the router serves the
    prompt whole (``decode_retry``) with the right answer, the decoder lives on, and a new
    prefiller on the address is paired again: a new NIXL engine id where the decoder holds the
    old one's handshake (vLLM issue 49238 saw the decoder segfault when its prefiller
    restarted)."""
    pre, dec = pd["prefill"], pd["decode"]
    until("a hand-off of the load: a handshake held", lambda: load.handshakes_before_fault() > 0)
    # token ids, not text: the router would ask an engine's /tokenize for a text's count, and
    # that may be the decoder held still
    status, tokenized, _ = engines.post(
        dec.url, "/tokenize", {"model": model_name, "prompt": text("churn-prefiller-killed", LONG_WORDS)}
    )
    assert status == 200, tokenized
    prompt = tokenized["tokens"]
    base = colocated(dec.url, model_name, False, prompt)
    retries = metric(router, "pd_router_fallbacks_total", reason="decode_retry")
    with ThreadPoolExecutor(1) as pool:
        with load.short_only():  # until the kill, the prefiller's one prefill leg is this prompt's
            before = prefills(pre)
            dec.signal(signal.SIGSTOP)
            asked = pool.submit(ask, router.url(), model_name, False, prompt, False)
            try:
                until("the prefiller answers the prefill leg", lambda: prefills(pre) > before)
                pre.signal(signal.SIGKILL)
                load.fault()
            finally:
                dec.signal(signal.SIGCONT)
        got = asked.result(timeout=2 * CLIENT_SECONDS)
    took = time.monotonic() - load.at
    print(f"churn: prefiller killed mid-transfer: the right answer, served whole, {took:.1f} s after the kill")
    assert (got.route, got.reason, got.text) == ("fallback", "decode_retry", base.text)
    assert metric(router, "pd_router_fallbacks_total", reason="decode_retry") > retries
    pre.restart()
    engines.wait_ready([pre])
    assert dec.popen is not None and dec.popen.poll() is None, dec.log_tail()
    took = disaggregated_again(router, dec.url, model_name, "churn-prefiller-killed-back")
    print(f"churn: prefiller replaced: disaggregated again {took:.1f} s after it was ready")
    print(f"churn: prefiller replaced: {load.settle(time.monotonic())}")
    print(f"churn: prefiller killed mid-transfer, {load.check(dec.url)}")
