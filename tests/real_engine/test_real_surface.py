"""What the project asserts about engines, against the real one: the engines started through the
chart's own preflight, the chart's `helm test` script against the router in front of them,
/v1/models from real model cards, and the router's answer to what vLLM refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from pd_router_dev.devstack import Proc

from tests import helm
from tests.real_engine import engines
from tests.real_engine.prompts import LONG_WORDS, text
from tests.real_engine.routers import Routers
from tests.real_engine.test_real_sim_differential import ERRORS, call, shape

# What the router refuses itself, before any engine (openai_wire.validate), and the field its
# message names; the engine judges the rest, and its very answer reaches the client.
ROUTER_JUDGES = {
    "a wrong type": "temperature",
    "no messages": "messages",
    "max_tokens below 1": "max_tokens",
    "empty messages": "messages",  # the router refuses an empty list before any engine
    "prompt_embeds without --enable-prompt-embeds": "prompt",  # it routes by a prompt it can read
}
PREFLIGHT_OK = "pd-inference preflight: ok (connector=nixl, backend=UCX, nixl 1.5.1"


def test_each_engine_started_through_the_charts_preflight(pd: dict[str, engines.Engine]) -> None:
    """The container entrypoint the chart renders checked NIXL's UCX backend in this engine's
    own Python, found vLLM 0.31.0 (one of the checked versions: no warning) and exec'd it."""
    for e in pd.values():
        log = e.log.read_text(errors="replace")
        lines = [x for x in log.splitlines() if x.startswith("pd-inference preflight:")]
        assert lines, f"{e.role}: no preflight line"  # one per start (a test restarts the prefiller)
        for line in lines:
            assert line.startswith(PREFLIGHT_OK) and line.endswith("vllm 0.31.0)"), line
        assert e.ready()


def test_models_are_the_engines_own_cards(router: Proc, pd: dict[str, engines.Engine], model_name: str) -> None:
    def get(base: str) -> tuple[dict, dict]:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            return json.loads(r.read()), dict(r.headers)

    ours, headers = get(router.url())
    theirs, _ = get(pd["decode"].url)
    assert headers.get("x-pd-models-source") == "engine"
    (card,) = ours["data"]
    # the engine also serves its KV revision's name (pd_router.revision); the router lists the
    # model once, with the revisions its engines run
    real, kv_card = theirs["data"]
    rev = kv_card["id"].removeprefix(model_name + "@kv-")
    assert kv_card["id"] != rev and card.pop("kv_revisions") == {"prefill": {rev: 1}, "decode": {rev: 1}}
    # a card's permission id is new at every answer (vLLM's ModelPermission default factory)
    assert shape(card) == shape(real)
    assert {k: v for k, v in card.items() if k not in ("created", "permission")} == {
        k: v for k, v in real.items() if k not in ("created", "permission")
    }
    assert card["id"] == model_name and card["max_model_len"] == 4096


@pytest.mark.parametrize("case", list(ERRORS))
def test_what_vllm_refuses_the_router_refuses_alike(case: str, router: Proc, pd: dict[str, engines.Engine]) -> None:
    """The same status as the real engine, and where the engine is the one to judge (it counts
    tokens, it knows its context length) its very answer, also on the disaggregated route."""
    path, body = ERRORS[case]
    theirs = call(pd["decode"].url, path, body)
    ours = call(router.url(), path, body)
    assert ours[0] == theirs[0]
    if case in ROUTER_JUDGES:  # the router's own check of the body: an OpenAI error naming it
        field = ROUTER_JUDGES[case]
        assert ours[1]["error"]["code"] == 400 and field in ours[1]["error"]["message"], ours
    else:
        assert ours[1] == theirs[1]


def test_a_long_prompt_over_the_context_is_vllms_400_through_the_prefiller(
    router: Proc, pd: dict[str, engines.Engine], model_name: str
) -> None:
    body = {"model": model_name, "prompt": text("over", 2000), "max_tokens": 3000}
    theirs = engines.post(pd["decode"].url, "/v1/completions", body)
    ours = engines.post(router.url(), "/v1/completions", body)
    assert ours[0] == theirs[0] == 400 and ours[1] == theirs[1]
    assert ours[2].get("x-pd-route") in ("disaggregated", "fallback"), ours[2]


def test_the_helm_test_script_passes_against_real_engines(h4, routers: Routers, pd: dict[str, engines.Engine]) -> None:
    """The chart's `helm test` pod script, taken from the rendered Pod of the dev environment,
    run against the router in front of the real engines: its short request goes direct and its
    long one is disaggregated."""
    from tests.cases import LAYERINGS

    docs = helm.render(h4, LAYERINGS[engines.RENDER])
    container = helm.one(docs, "Pod", "-helm-test")["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    router = routers.start([pd["prefill"].url], [pd["decode"].url])
    proc = subprocess.run(
        [sys.executable, "-c", container["args"][0]],
        env={**os.environ, **env, "ROUTER_URL": router.url()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "short: route=direct reason=below_threshold expected=direct answered=True" in proc.stdout
    assert "long: route=disaggregated reason=above_threshold expected=disaggregated" in proc.stdout


def test_a_long_prompt_the_engine_cannot_hold_is_refused_not_split(router: Proc, model_name: str) -> None:
    """Over the context on the disaggregated route too: a clean 400, no hang, no 5xx."""
    status, body, _ = engines.post(
        router.url(),
        "/v1/chat/completions",
        {"model": model_name, "messages": [{"role": "user", "content": text("x", LONG_WORDS * 6)}]},
    )
    assert status == 400 and "maximum context length" in body["error"]["message"]
