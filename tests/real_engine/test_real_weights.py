"""Weights identity at admission on vLLM's CPU build (pd_router.weights): a prefiller and a
decoder that hold different weights under one name, one ``--model`` string and one KV revision
are never paired.

This is how it happens in production: ``model.revision`` left empty follows the hub's moving
branch, and a pod started after an upstream push loads other weights under the same name. Here
the two engines are started from one path, a link, pointed at the dense model's weights for the
decoder and, once that has loaded, at its second weight set (same config and tokenizer) for the
prefiller. Both serve the revision's name the chart renders, and NIXL's compatibility hash (it
covers the ``--model`` string, not the weights: ``compute_nixl_compatibility_hash``, vLLM 0.31.0)
lets them hand KV to each other.

- With the router's weights check (the chart's default), every long prompt is served whole by
  the decoder (fallback ``weights_differ``) and equals the decoder's own answer; the router logs
  both engines and counts two weight sets.
- Without it (negative control, run last: the decoder's prefix cache keeps the foreign KV), the
  same prompts are disaggregated across the two weight sets and come back wrong.

Measured (this 2-core machine, 2026-12-06, ``pytest tests/real_engine/test_real_weights.py -s``):
see docs/testing.md; the test prints the probe's cost per engine and the wrong answers of the
negative control.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_router import weights

from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers

PROMPTS = [text(f"weights-{i}", LONG_WORDS) for i in range(4)]
LEARN_SECONDS = 120  # the router's health checks run every second here


def point(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` in one step (a rename over the old link)."""
    tmp = link.with_name(link.name + ".new")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


@pytest.fixture(scope="module")
def mixed(pairs: Pairs, workdir: Path) -> Iterator[tuple[engines.Engine, engines.Engine]]:
    """(prefiller on the second weight set, decoder on the first), one ``--model`` string."""
    pairs.stop()  # two engines of their own: the machine to themselves
    folder = workdir / "weights"
    folder.mkdir(exist_ok=True)
    link = folder / "dense"
    started: list[engines.Engine] = []
    try:
        point(link, engines.model("dense", 0))
        dec = engines.engine("decode", "dense", 1, folder, model_path=link)
        started.append(dec.start())
        engines.wait_ready([dec])
        point(link, engines.model("dense", 1))  # the upstream push, between two pod starts
        pre = engines.engine("prefill", "dense", 0, folder, model_path=link)
        started.append(pre.start())
        engines.wait_ready([pre])
        yield pre, dec
    finally:
        for e in started:
            e.stop()


def weight_sets(router_url: str) -> dict[tuple[str, str], float]:
    """The router's healthy engines by (pool, weight set)."""
    out: dict[tuple[str, str], float] = {}
    for labels, v in engines.samples(engines.metrics_text(router_url), "pd_router_weight_set_endpoints"):
        if v:
            out[(labels["pool"], labels["weights"])] = v
    return out


def wait_sets(router_url: str) -> dict[tuple[str, str], float]:
    """Until the router has read both engines' weights (its own health checks, with a deadline)."""
    deadline = time.monotonic() + LEARN_SECONDS
    got: dict[tuple[str, str], float] = {}
    while time.monotonic() < deadline:
        got = weight_sets(router_url)
        if sum(got.values()) == 2 and "unknown" not in {w for _, w in got}:
            return got
        time.sleep(0.5)  # polling the router's health checks, not synchronising the test
    raise AssertionError(f"the router's weight sets stayed {got}")


def test_weights_other_weights_under_one_revision_are_never_paired(
    mixed: tuple[engines.Engine, engines.Engine], routers: Routers, model_name: str
) -> None:
    pre, dec = mixed
    models = {e.role: [a for a in e.argv if a.startswith("--model=")] for e in (pre, dec)}
    assert models["prefill"] == models["decode"] == [f"--model={pre.log.parent / 'dense'}"], models
    # the two weight sets answer differently (else the test proves nothing), and the probe
    # tells them apart: what the router compares, and what it costs an admission
    probes = {}
    for e in (pre, dec):
        t0 = time.perf_counter()
        status, body, _ = engines.post(e.url, "/v1/completions", weights.probe_body(model_name))
        probes[e.role] = (weights.from_answer(body), time.perf_counter() - t0)
        assert status == 200, body
    t0 = time.perf_counter()
    again = weights.from_answer(engines.post(dec.url, "/v1/completions", weights.probe_body(model_name))[1])
    warm = time.perf_counter() - t0
    assert again.matches(probes["decode"][0])  # the same engine, asked twice: the same set
    assert not probes["prefill"][0].matches(probes["decode"][0])
    print(
        f"\nweights probe, an engine's first request: {', '.join(f'{r} {t * 1000:.0f} ms ({fp})' for r, (fp, t) in probes.items())}"
        f"; asked again: {warm * 1000:.0f} ms"
    )
    right = {q: colocated(dec.url, model_name, True, q).text for q in PROMPTS}
    theirs = {q: colocated(pre.url, model_name, True, q).text for q in PROMPTS}
    assert right != theirs

    router = routers.start([pre.url], [dec.url])
    try:
        sets = wait_sets(router.url())
        assert {w for _, w in sets} == {"0", "1"}, sets  # one engine in each
        answers = [ask(router.url(), model_name, True, q, stream=i % 2 == 1) for i, q in enumerate(PROMPTS)]
        log = router.log_tail(10**6)
    finally:
        router.stop()
    assert [(a.route, a.reason) for a in answers] == [("fallback", "weights_differ")] * len(PROMPTS)
    assert [a.text for a in answers] == [right[q] for q in PROMPTS]
    (line,) = [x for x in log.splitlines() if "holds other weights than" in x]
    assert pre.url in line and dec.url in line


def test_weights_without_the_check_the_same_engines_are_paired_and_answer_wrong(
    mixed: tuple[engines.Engine, engines.Engine], routers: Routers, model_name: str
) -> None:
    """Negative control (last: the decoder's prefix cache keeps the foreign KV)."""
    pre, dec = mixed
    prompts = [text(f"weights-unchecked-{i}", LONG_WORDS) for i in range(4)]  # none cached yet
    right = {q: colocated(dec.url, model_name, True, q).text for q in prompts}
    router = routers.start([pre.url], [dec.url], env={"PD_ROUTER__HEALTH__WEIGHTSCHECK": "false"})
    try:
        wait_sets(router.url())
        answers = [ask(router.url(), model_name, True, q, stream=False) for q in prompts]
    finally:
        router.stop()
    assert [(a.route, a.reason) for a in answers] == [("disaggregated", "above_threshold")] * len(prompts)
    wrong = sum(a.text != right[q] for a, q in zip(answers, prompts, strict=True))
    print(f"\nwithout the weights check: {wrong} of {len(prompts)} answers wrong")
    assert wrong >= 1
