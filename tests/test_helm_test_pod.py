"""The chart's `helm test` pod, run for real: its script (taken from the rendered Pod) talks to the
router and simulated engines on loopback, and passes only when the short request went direct and
the long one was disaggregated. Where the route is decided per request (router.decision goodput, or
one engine pool), the script asks each answer for its route and a reason of the decision or of a
fallback instead, run here against a stand-in that answers with chosen headers."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_router_dev.devstack import DEMO_CONFIG, Proc, Stack, free_port

from tests import helm

THRESHOLD = 64
pytestmark = pytest.mark.xdist_group("processes")


def _pod(h4: Path, threshold: int) -> tuple[str, dict[str, str]]:
    docs = helm.render(h4, sets=(f"router.threshold={threshold}", "kvTransfer.connector=nixl"))
    container = helm.one(docs, "Pod", "-helm-test")["spec"]["containers"][0]
    assert container["command"] == ["python", "-c"]
    return container["args"][0], {e["name"]: e["value"] for e in container["env"]}


@pytest.fixture(scope="module")
def router() -> Iterator[Proc]:
    served = "qwen3.5-9b"  # the chart's default model.servedName
    with Stack() as stack:
        prefill = stack.sim("helmtest-prefill", "--kv-connector", "nixl", "--model", served)
        decode = stack.sim("helmtest-decode", "--kv-connector", "nixl", "--model", served)
        env = {
            "PD_ROUTER__ROUTING__CONNECTOR": "nixl",
            "PD_ROUTER__ROUTING__THRESHOLD": str(THRESHOLD),
            "PD_ROUTER__MODEL__SERVEDNAME": served,
            "PD_ROUTER__LMCACHE__NOTIFYPORT": str(free_port()),
            "PD_ROUTER__POOLS__PREFILL__STATIC": f"[{prefill.url()}]",
            "PD_ROUTER__POOLS__DECODE__STATIC": f"[{decode.url()}]",
        }
        yield stack.router("helmtest-router", DEMO_CONFIG, env)


def _run_script(script: str, env: dict[str, str], router: Proc) -> subprocess.CompletedProcess[str]:
    env = {**env, "ROUTER_URL": router.url()}
    return subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_helm_test_script_passes_against_a_router(h4: Path, router: Proc) -> None:
    script, env = _pod(h4, THRESHOLD)
    result = _run_script(script, env, router)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "short: route=direct reason=below_threshold expected=direct answered=True" in result.stdout
    assert "long: route=disaggregated reason=above_threshold expected=disaggregated" in result.stdout


def test_helm_test_script_passes_when_run_again(h4: Path, router: Proc) -> None:
    """`helm test` twice: the second long prompt is new to the router's prefix index too."""
    script, env = _pod(h4, THRESHOLD)
    for _ in range(2):
        result = _run_script(script, env, router)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "long: route=disaggregated reason=above_threshold" in result.stdout


def test_helm_test_script_fails_when_a_route_is_wrong(h4: Path, router: Proc) -> None:
    # Rendered for threshold 0 (everything disaggregated) against a router whose threshold is 64:
    # the short request goes direct, which the test must report as a failure.
    script, env = _pod(h4, 0)
    result = _run_script(script, env, router)
    assert result.returncode == 1
    assert "short: route=direct reason=below_threshold expected=disaggregated" in result.stdout


# --- per request: router.decision goodput, or one engine pool (engine.layout flexible) ---------------

FLEXIBLE = ("engine.layout=flexible", "prefill.replicas=0")
GOODPUT_REASONS = ("handoff_not_worth", "whole_best", "one_engine_enough", "split_protects_itl", "split_faster")


def _per_request_pod(h4: Path, sets: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    docs = helm.render(h4, sets=sets)
    container = helm.one(docs, "Pod", "-helm-test")["spec"]["containers"][0]
    return container["args"][0], {e["name"]: e["value"] for e in container["env"]}


@contextlib.contextmanager
def _answering(headers: list[dict[str, str]], tokens: int = 8) -> Iterator[str]:
    """A stand-in router on loopback: answers each chat completion with the next headers."""
    answers = iter(headers)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(
                {"choices": [{"message": {"content": "hi " * tokens}}], "usage": {"completion_tokens": tokens}}
            ).encode()
            self.send_response(200)
            for name, value in next(answers).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _run_against(script: str, env: dict[str, str], url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env, "ROUTER_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _headers(route: str, reason: str) -> dict[str, str]:
    return {"x-pd-route": route, "x-pd-reason": reason}


@pytest.mark.parametrize("sets", [(*FLEXIBLE, "router.decision=goodput"), ("router.decision=goodput",)])
def test_the_goodput_test_asks_for_an_answer_a_route_and_a_goodput_reason(h4: Path, sets: tuple[str, ...]) -> None:
    script, env = _per_request_pod(h4, sets)
    answers = [_headers("direct", "whole_best"), _headers("disaggregated", "split_faster")]
    with _answering(answers) as url:
        result = _run_against(script, env, url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "short: route=direct reason=whole_best answered=True" in result.stdout
    assert "long: route=disaggregated reason=split_faster answered=True" in result.stdout
    # a long prompt served whole is the router's call, and so is a fallback
    answers = [_headers("direct", "handoff_not_worth"), _headers("fallback", "prefill_timeout")]
    with _answering(answers) as url:
        assert _run_against(script, env, url).returncode == 0


@pytest.mark.parametrize(
    "answers,words",
    [
        # negative controls: a reason of another decision, no reason, no route, a short answer
        ([_headers("direct", "whole_best"), _headers("disaggregated", "above_threshold")], "reason=above_threshold"),
        ([_headers("direct", "whole_best"), {"x-pd-route": "direct"}], "reason=None"),
        ([_headers("direct", "whole_best"), {"x-pd-reason": "split_faster"}], "route=None"),
    ],
)
def test_the_goodput_test_fails_without_a_route_and_a_goodput_reason(
    h4: Path, answers: list[dict[str, str]], words: str
) -> None:
    script, env = _per_request_pod(h4, (*FLEXIBLE, "router.decision=goodput"))
    with _answering(answers) as url:
        result = _run_against(script, env, url)
    assert result.returncode == 1, result.stdout
    assert words in result.stdout.splitlines()[1], result.stdout
    with _answering([_headers("direct", "whole_best")] * 2, tokens=3) as url:
        result = _run_against(script, env, url)
    assert result.returncode == 1 and "answered=False" in result.stdout


def test_the_reasons_the_test_accepts_are_the_routers() -> None:
    """The decision's own reasons, then the fallbacks' (templates/_helpers.tpl
    pd-inference.routeReasons), against pd_router.metrics: between them the goodput decision's and
    the prefix and length decisions' are every reason DECIDED holds (batch aside: the test sends
    single requests), and every decision may fall back with a FALLBACK_REASONS reason."""
    from pd_router import metrics

    h4 = helm.helm_binaries()[0]
    fallbacks = list(metrics.FALLBACK_REASONS)

    def accepted(sets: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """(the decision's own reasons, the fallbacks') the rendered test accepts."""
        reasons = _per_request_pod(h4, sets)[1]["REASONS"].split(",")
        return reasons[: -len(fallbacks)], reasons[-len(fallbacks) :]

    threshold, after = accepted(FLEXIBLE)  # one engine pool, the prefix decision
    assert after == fallbacks
    assert accepted((*FLEXIBLE, "router.decision=length")) == (threshold, fallbacks)
    for sets in ((*FLEXIBLE, "router.decision=goodput"), ("router.decision=goodput",)):
        assert accepted(sets) == (list(GOODPUT_REASONS), fallbacks), sets
    assert set(threshold).isdisjoint(GOODPUT_REASONS)
    assert set(threshold) | set(GOODPUT_REASONS) == {reason for _, reason in metrics.DECIDED} - {"batch"}
    # split with prefix or length keeps the route assertions (and no REASONS)
    assert "REASONS" not in _per_request_pod(h4, ())[1]


def test_the_goodput_test_passes_against_a_router_of_one_flexible_pool(h4: Path, tmp_path: Path) -> None:
    """The chart's own router config for one engine pool and the goodput decision (its pools,
    routing.goodput), engines listed statically: the real router serves both requests with a
    route and a goodput reason, and the rendered script accepts them."""
    import yaml

    sets = (*FLEXIBLE, "router.decision=goodput", f"router.threshold={THRESHOLD}")
    docs = helm.render(h4, sets=sets)
    cfg = yaml.safe_load(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])
    script, env = _per_request_pod(h4, sets)
    served = "qwen3.5-9b"  # the chart's default model.servedName
    with Stack() as stack:
        engines = [stack.sim(f"helmtest-flex-{i}", "--kv-connector", "nixl", "--model", served) for i in range(2)]
        cfg["listen"] = {"host": "127.0.0.1", "port": 0, "workers": 1}
        cfg["pools"]["decode"] = {"discovery": "static", "static": [e.url() for e in engines]}
        cfg["routing"]["kvEvents"]["enabled"] = False  # the simulators here publish none
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(cfg))
        router = stack.router("helmtest-flex-router", path, {})
        result = _run_script(script, env, router)
    assert result.returncode == 0, result.stdout + result.stderr
    for line, name in zip(result.stdout.splitlines(), ("short", "long"), strict=True):
        reason = line.split("reason=")[1].split()[0]
        assert line.startswith(f"{name}: route=") and reason in GOODPUT_REASONS, line
