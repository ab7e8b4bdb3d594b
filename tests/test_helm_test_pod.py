"""The chart's `helm test` pod, run for real: its script (taken from the rendered Pod) talks to the
router and simulated engines on loopback, and passes only when the short request went direct and
the long one was disaggregated."""

from __future__ import annotations

import os
import subprocess
import sys
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
