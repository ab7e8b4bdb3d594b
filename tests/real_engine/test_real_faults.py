"""A broken hand-off on the real engines ends as a fallback with its reason or a clean error:
never a wrong answer, never an empty one, never a hang (every call here has a timeout)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_router_dev.devstack import Proc, Stack

from tests.real_engine import engines
from tests.real_engine.load import CLIENT_SECONDS, back, disaggregated_again, metric, running, until
from tests.real_engine.prompts import LONG_WORDS, Answer, ask, colocated, text
from tests.real_engine.routers import Routers


@pytest.fixture(scope="module")
def tampered(pd: dict[str, engines.Engine], routers: Routers, workdir: Path) -> Iterator[tuple[Proc, Proc]]:
    """A router whose only prefiller is reached through the tampering proxy; (router, proxy)."""
    with Stack(workdir / "tamper") as st:
        pre = pd["prefill"]
        assert pre.popen is not None
        proxy = st.adopt(_spawn_tamper(workdir, pre))
        r = routers.start([proxy.url()], [pd["decode"].url])
        yield r, proxy


def _spawn_tamper(workdir: Path, pre: engines.Engine) -> Proc:
    from pd_router_dev import devstack

    assert pre.popen is not None
    (workdir / "tamper").mkdir(exist_ok=True)
    args = [sys.executable, "-m", "tests.real_engine.tamper", "--upstream", pre.url, "--kill-pgid", str(pre.popen.pid)]
    return devstack._spawn("tamper", args, workdir / "tamper", {"PYTHONPATH": str(engines.stack.ROOT)})


def arm(proxy: Proc, mode: str, count: int = 1) -> None:
    status, body, _ = engines.post(proxy.url(), "/tamper", {"mode": mode, "count": count})
    assert status == 200, body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_side_channel_nobody_answers_on_falls_back_to_the_right_answer(
    stream: bool, tampered: tuple[Proc, Proc], pd: dict[str, engines.Engine], model_name: str
) -> None:
    """The decoder cannot reach the prefiller's side channel (vLLM waits for its handshake, then
    fails the request: a 500, or on a stream an opening chunk and [DONE] with no token): the
    router serves the prompt again without the hand-off, and says so."""
    router, proxy = tampered
    prompt = text(f"wrong-port-{stream}", LONG_WORDS)
    base = colocated(pd["decode"].url, model_name, True, prompt)
    before = metric(router, "pd_router_fallbacks_total", reason="decode_retry")
    arm(proxy, "wrong_port")
    got = ask(router.url(), model_name, True, prompt, stream)
    assert (got.route, got.reason) == ("fallback", "decode_retry")
    assert got.text == base.text and got.finish == "length"
    assert metric(router, "pd_router_fallbacks_total", reason="decode_retry") == before + 1


def test_churn_the_side_channel_blocked_under_load(
    tampered: tuple[Proc, Proc],
    routers: Routers,
    pd: dict[str, engines.Engine],
    model_name: str,
    request: pytest.FixtureRequest,
) -> None:
    """Every hand-off's side channel blocked mid-run, under the churn tests' load
    (tests/real_engine/load.py), then open again: each long prompt meanwhile is served whole
    with the right answer (``decode_retry``, or ``handoff_failing`` while the pair is out); the
    failed hand-offs quarantine the pair (pd_router.pairs) and abandon the others waiting on
    it, and eject neither engine (no ``no_prefiller``; an ejected sole decoder would show up as
    errors); once the channel opens long prompts are disaggregated again. A router of its own,
    quarantining for 1 s (the chart's 30 s would only make it wait)."""
    _, proxy = tampered
    router = routers.start([proxy.url()], [pd["decode"].url], env={"PD_ROUTER__HEALTH__EJECTIONSECONDS": "1"})
    back(router, "prefill")
    back(router, "decode")
    ejected = metric(router, "pd_router_fallbacks_total", reason="no_prefiller")
    quarantined = metric(router, "pd_router_fallbacks_total", reason="handoff_failing")
    with running(router, model_name, request.node.name) as load:
        try:
            arm(proxy, "wrong_port", -1)  # every hand-off from now on
            load.fault()
            prompt = text("churn-side-channel", LONG_WORDS)
            got = ask(router.url(), model_name, True, prompt, True)
            took = time.monotonic() - load.at
            assert got.route == "fallback" and got.reason in ("decode_retry", "handoff_failing"), got
            assert got.text == colocated(pd["decode"].url, model_name, True, prompt).text
            until(
                "a long prompt served whole, without a prefill, while the pair is out",
                lambda: metric(router, "pd_router_fallbacks_total", reason="handoff_failing") > quarantined,
                4 * CLIENT_SECONDS,
            )
            print(f"churn: side channel blocked: the right answer, served whole, {took:.1f} s after the block")
        finally:
            arm(proxy, "pass")
            opened = time.monotonic()
        again = disaggregated_again(router, pd["decode"].url, model_name, "churn-side-channel-back")
        print(f"churn: side channel open: disaggregated again {again:.1f} s after")
        print(f"churn: side channel open: {load.settle(time.monotonic())}")
        # no error at all: an ejected decoder (the only one) would have answered 503s
        print(f"churn: side channel blocked, {load.check(pd['decode'].url, errors=False)}")
        print(f"churn: side channel blocked, {load.longest(load.at, opened)}")
    assert metric(router, "pd_router_fallbacks_total", reason="no_prefiller") == ejected, "the prefiller was ejected"


@pytest.fixture
def restore_prefiller(pd: dict[str, engines.Engine]) -> Iterator[engines.Engine]:
    pre = pd["prefill"]
    yield pre
    if pre.popen is None or pre.popen.poll() is not None or not pre.ready():
        pre.restart()
        engines.wait_ready([pre])


def test_a_prefiller_killed_after_its_prefill_falls_back_to_the_right_answer(
    tampered: tuple[Proc, Proc], restore_prefiller: engines.Engine, pd: dict[str, engines.Engine], model_name: str
) -> None:
    """The prefiller answers and dies before the decoder pulls its KV: the decoder's transfer
    fails (kv_load_failure_policy fail) and the router serves the prompt on the decoder."""
    router, proxy = tampered
    prompt = text("killed-after", LONG_WORDS)
    base = colocated(pd["decode"].url, model_name, False, prompt)
    arm(proxy, "kill")
    got = ask(router.url(), model_name, False, prompt, True)
    assert got.route == "fallback" and got.text == base.text, got
    # the next long prompt finds no prefiller to talk to, or its pair out after its failed
    # hand-offs (pd_router.pairs), and is served directly, right
    prompt2 = text("killed-after-2", LONG_WORDS)
    base2 = colocated(pd["decode"].url, model_name, False, prompt2)
    got2 = ask(router.url(), model_name, False, prompt2, False)
    assert got2.route == "fallback" and got2.reason in ("prefill_error", "no_prefiller", "handoff_failing")
    assert got2.text == base2.text


def test_a_prefiller_killed_mid_prefill_falls_back_to_the_right_answer(
    router: Proc, restore_prefiller: engines.Engine, pd: dict[str, engines.Engine], model_name: str
) -> None:
    """The prefiller is frozen with the request's prefill leg open on it, then killed."""
    pre = restore_prefiller
    prompt = text("killed-mid", LONG_WORDS)
    base = colocated(pd["decode"].url, model_name, True, prompt)
    pre.signal(signal.SIGSTOP)
    out: list[Answer | BaseException] = []

    def call() -> None:
        try:
            out.append(ask(router.url(), model_name, True, prompt, False))
        except BaseException as exc:  # reported below
            out.append(exc)

    t = threading.Thread(target=call)
    t.start()
    try:
        deadline = time.monotonic() + 60
        # the prefill leg is open on the frozen prefiller (the router counts it outstanding)
        while metric(router, "pd_router_outstanding", pool="prefill") < 1:
            assert time.monotonic() < deadline, "the prefill leg never started"
            time.sleep(0.05)
    finally:
        pre.signal(signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the request hung"
    (got,) = out
    assert isinstance(got, Answer), got
    assert (got.route, got.reason) == ("fallback", "prefill_error") and got.text == base.text
