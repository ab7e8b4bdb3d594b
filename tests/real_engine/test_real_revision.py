"""A rollout of both roles to another model revision, on vLLM's CPU build, through the router:
prefill and decode are paired only within one KV revision (pd_router.revision), and vLLM itself
refuses a pair across revisions.

Two weight sets of one tiny model (same config and tokenizer, each in its own folder) stand for
two revisions; the chart renders the dev environment at two ``model.revision`` values, so each
engine serves its KV revision's name as the chart has it. The fleet is one prefiller and two
decoders, replaced one pod at a time in StatefulSet order (the prefiller, then decoder 1, then
decoder 0), each new pod on its old address, as a pod keeps its name:

    state 0   P:r0  D0:r0  D1:r0     before
    state 1   P:r1  D0:r0  D1:r0     no same-revision pair: long prompts served directly
    state 2   P:r1  D0:r0  D1:r1     long prompts paired with D1 only
    state 3   P:r1  D0:r1  D1:r1     after

In every state a batch of requests runs four at a time: long prompts asked before the rollout,
long prompts first asked during it (and asked again after it), and short ones. Every answer must
equal what a decoder of the revision that answered (``x-pd-kv-revision``) gives for the prompt
alone with a fresh cache salt. Requests run in the states, not across the instant a pod is
replaced: a replaced pod's in-flight requests are the drain's business (docs/operating.md), not
the pairing's.

Measured (this 2-core machine, 2026-12-02, ``pytest tests/real_engine/test_real_revision.py -s``,
6 min 30 s): 29 requests (21 long, 8 short), 0 failed, every answer equal to its revision's own;
state 1: 3 long prompts ``no_revision_pair`` and 3 ``prefix_cached`` on their old decoder, none
disaggregated; state 2: 4 disaggregated, all to the rolled decoder, 2 ``prefix_cached``; so 4 of
the rollout's 12 long prompts (33 %) were disaggregated, 0 across revisions. Bypassing the
router, decoder 0 (revision 0) handed revision 1's KV logged "NIXL compatibility hash mismatch"
and answered 500 (loadFailurePolicy ``fail``). The test prints the share each run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.engines import rendered
from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.prompts import LONG_WORDS, SHORT_WORDS, Answer, ask, colocated, text
from tests.real_engine.routers import Routers

RENDERS = tuple(rendered.REAL_ONLY_RENDERS)  # the dev environment at model revisions 0 and 1
OLD = [text(f"revision-old-{i}", LONG_WORDS) for i in range(3)]
NEW = [text(f"revision-new-{i}", LONG_WORDS) for i in range(3)]
# first asked after the rollout: the others may all sit in a rolled decoder's prefix cache then
# (disaggregated to it in state 2), served there whole; these must be disaggregated
LATE = [text(f"revision-late-{i}", LONG_WORDS) for i in range(2)]
SHORT = [text(f"revision-short-{i}", SHORT_WORDS) for i in range(2)]
LEARN_SECONDS = 120  # the router's health checks run every second here


def kv_revision(rev: int) -> str:
    """The KV revision the chart renders for model revision ``rev``."""
    served, name = engines.chart_engine("decode", RENDERS[rev]).served_names
    return name.removeprefix(served + "@kv-")


@dataclass
class Asked:
    state: int
    prompt: str
    long: bool
    answer: Answer | None = None
    error: str = ""


@dataclass
class Rollout:
    kv: tuple[str, str]
    asked: list[Asked] = field(default_factory=list)
    refs: dict[str, dict[str, str]] = field(default_factory=dict)  # kv revision -> prompt -> text
    refused_name: tuple[int, Any] = (0, None)  # a decoder asked for the other revision's name
    handshake: tuple[int, Any, str] = (0, None, "")  # foreign KV handed to a decoder directly
    fallbacks: dict[int, float] = field(default_factory=dict)  # router's no_revision_pair, per state


class Fleet:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.pods: dict[str, engines.Engine] = {}

    def start(self, name: str, role: str, rev: int, core: int, port: int | None = None) -> engines.Engine:
        e = engines.engine(role, "dense", core, self.workdir, render=RENDERS[rev], weights=rev, port=port)
        self.pods[name] = e.start()
        return e

    def replace(self, name: str, rev: int) -> None:
        old = self.pods[name]
        old.stop()  # a StatefulSet replaces a pod: the old one goes, then the new one comes
        engines.wait_ready([self.start(name, old.role, rev, old.core, old.port)])

    def stop(self) -> None:
        for e in self.pods.values():
            e.stop()


def wait_learnt(router_url: str, prefill: dict[str, int], decode: dict[str, int]) -> None:
    """Until the router's /v1/models shows these healthy revisions (polling a state the router
    reaches by its own health checks, with a deadline)."""
    import json
    import urllib.request

    deadline = time.monotonic() + LEARN_SECONDS
    want = {"prefill": prefill, "decode": decode}
    got: Any = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(router_url + "/v1/models", timeout=10) as r:
            got = json.loads(r.read())["data"][0]["kv_revisions"]
        if got == want:
            return
        time.sleep(0.5)  # polling the router's health checks, not synchronising the test
    raise AssertionError(f"the router's kv_revisions stayed {got}, not {want}")


def fallbacks(router_url: str) -> float:
    return engines.value(engines.metrics_text(router_url), "pd_router_fallbacks_total", reason="no_revision_pair")


@pytest.fixture(scope="module")
def rollout(pairs: Pairs, routers: Routers, workdir: Path, model_name: str) -> Iterator[Rollout]:
    pairs.stop()  # three engines: the machine to themselves
    kv = (kv_revision(0), kv_revision(1))
    assert kv[0] != kv[1]
    out = Rollout(kv)
    fleet = Fleet(workdir / "revision")
    fleet.workdir.mkdir(exist_ok=True)
    router = None
    try:
        fleet.start("prefill-0", "prefill", 0, 0)
        fleet.start("decode-0", "decode", 0, 1)
        fleet.start("decode-1", "decode", 0, 1)
        engines.wait_ready(fleet.pods.values())
        p, d0, d1 = (fleet.pods[n] for n in ("prefill-0", "decode-0", "decode-1"))
        router = routers.start([p.url], [d0.url, d1.url])
        url = router.url()
        # revision 0's own answers, each prompt alone on a fresh cache salt
        out.refs[kv[0]] = {q: colocated(d0.url, model_name, True, q).text for q in OLD + NEW + SHORT}

        def state(n: int, prompts: list[tuple[str, bool]]) -> None:
            before = fallbacks(url)

            def one(item: tuple[str, bool]) -> Asked:
                a = Asked(n, item[0], item[1])
                try:
                    a.answer = ask(url, model_name, True, item[0], False)
                except Exception as exc:  # recorded: the test counts failures
                    a.error = repr(exc)
                return a

            with ThreadPoolExecutor(4) as pool:
                out.asked += list(pool.map(one, prompts))
            out.fallbacks[n] = fallbacks(url) - before

        wait_learnt(url, {kv[0]: 1}, {kv[0]: 2})
        state(0, [(q, True) for q in OLD] + [(q, False) for q in SHORT])

        fleet.replace("prefill-0", 1)
        wait_learnt(url, {kv[1]: 1}, {kv[0]: 2})
        # vLLM's own refusals, bypassing the router: the other revision's name ...
        status, body, _ = engines.post(
            d0.url, "/v1/completions", {"model": f"{model_name}@kv-{kv[1]}", "prompt": "hi", "max_tokens": 2}
        )
        out.refused_name = (status, body)
        # ... and revision 1's KV handed to a revision 0 decoder, the pairing the router refuses
        p = fleet.pods["prefill-0"]
        prompt = text("revision-handshake", LONG_WORDS)
        pre_body = {
            "model": model_name,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        _, pre, _ = engines.post(p.url, "/v1/completions", pre_body)
        dec_body = {"model": model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        dec_body["kv_transfer_params"] = pre["kv_transfer_params"]
        status, body, _ = engines.post(d0.url, "/v1/completions", dec_body)
        out.handshake = (status, body, d0.log_tail(10**7))
        state(1, [(q, True) for q in OLD + NEW] + [(q, False) for q in SHORT])

        fleet.replace("decode-1", 1)
        wait_learnt(url, {kv[1]: 1}, {kv[0]: 1, kv[1]: 1})
        state(2, [(q, True) for q in OLD + NEW] + [(q, False) for q in SHORT])

        fleet.replace("decode-0", 1)
        wait_learnt(url, {kv[1]: 1}, {kv[1]: 2})
        d0 = fleet.pods["decode-0"]
        out.refs[kv[1]] = {q: colocated(d0.url, model_name, True, q).text for q in OLD + NEW + LATE + SHORT}
        state(3, [(q, True) for q in OLD + NEW + LATE] + [(q, False) for q in SHORT])
        yield out
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def test_revision_rollout_fails_no_request_and_every_answer_is_its_revisions_own(rollout: Rollout) -> None:
    failed = [a for a in rollout.asked if a.answer is None]
    assert not failed, failed
    kv0, kv1 = rollout.kv
    # the two revisions really answer differently: a cross-revision answer could not pass
    differ = [q for q in OLD + NEW if rollout.refs[kv0][q] != rollout.refs[kv1][q]]
    assert len(differ) == len(OLD + NEW)
    wrong = []
    for a in rollout.asked:
        assert a.answer is not None and a.answer.kv_revision in rollout.kv, a
        if a.answer.text != rollout.refs[a.answer.kv_revision][a.prompt]:
            wrong.append((a.state, a.long, a.answer.route, a.answer.kv_revision))
    assert not wrong, wrong
    # prompts first seen during the rollout, asked again after it: revision 1's own answers
    after = [a for a in rollout.asked if a.state == 3 and a.prompt in NEW]
    assert len(after) == len(NEW) and all(a.answer and a.answer.kv_revision == kv1 for a in after)


def test_revision_pairing_never_hands_kv_across_revisions(rollout: Rollout) -> None:
    """Long prompts are disaggregated within one revision, or served directly where no pair is
    (counted) or where the decoder already holds the prompt (``prefix_cached``: asked before)."""
    kv0, kv1 = rollout.kv
    by_state: dict[int, list[Answer]] = {}
    for a in rollout.asked:
        if a.long and a.answer is not None:
            by_state.setdefault(a.state, []).append(a.answer)
    cached = ("direct", "prefix_cached")
    # before and after: within its revision (or the decoder's own cache)
    for n, rev in ((0, kv0), (3, kv1)):
        got = {(x.route, x.kv_revision) for x in by_state[n] if (x.route, x.reason) != cached}
        assert got == {("disaggregated", rev)}, (n, got)
    late = [a.answer for a in rollout.asked if a.prompt in LATE and a.answer is not None]
    assert [(x.route, x.kv_revision) for x in late] == [("disaggregated", kv1)] * len(LATE), late
    # the prefiller rolled, no decoder yet: no pair, every long prompt served directly (counted,
    # the prompts first seen now among them), none disaggregated
    unpaired = [x for x in by_state[1] if (x.route, x.reason) != cached]
    assert {(x.route, x.reason, x.kv_revision) for x in unpaired} == {("fallback", "no_revision_pair", kv0)}
    assert len(unpaired) >= len(NEW) and rollout.fallbacks[1] == len(unpaired)
    assert {x.kv_revision for x in by_state[1]} == {kv0}
    # one decoder rolled: long prompts paired with it only (the other one has no prefiller)
    split = [x for x in by_state[2] if (x.route, x.reason) != cached]
    assert split and {(x.route, x.kv_revision) for x in split} == {("disaggregated", kv1)}
    assert rollout.fallbacks[0] == rollout.fallbacks[2] == rollout.fallbacks[3] == 0
    during = by_state[1] + by_state[2]
    share = sum(x.route == "disaggregated" for x in during) / len(during)
    routes = {n: sorted((x.route, x.reason) for x in xs) for n, xs in sorted(by_state.items())}
    print(f"long prompts disaggregated during the rollout (states 1-2): {share:.0%} of {len(during)}; {routes}")


def test_revision_vllm_refuses_a_request_for_another_revisions_name(rollout: Rollout) -> None:
    status, body = rollout.refused_name
    assert status == 404, body
    assert "does not exist" in body["error"]["message"], body


def test_revision_vllms_nixl_handshake_refuses_kv_of_other_weights(rollout: Rollout) -> None:
    """The folder names the weights, so the two revisions' ``--model`` strings differ and with
    them NIXL's compatibility hash: the decoder refuses the prefiller's KV (and, with the
    chart's loadFailurePolicy ``fail``, the request) instead of computing with it."""
    status, body, log = rollout.handshake
    assert "NIXL compatibility hash mismatch" in log
    assert status != 200 or body["choices"][0]["finish_reason"] == "error", (status, body)
