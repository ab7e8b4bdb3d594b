"""Routers in front of real engines, configured from the chart's own router.yaml: the
real-engine tier's (tests/real_engine/conftest.py) and ``make demo-real``'s
(tests/real_engine/demo.py), one place for both."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import yaml
from pd_router_dev.devstack import Proc, Stack

from tests import helm
from tests.cases import LAYERINGS
from tests.real_engine import engines


def chart_router_config(render: str = engines.RENDER, sets: tuple[str, ...] = ()) -> dict:
    docs = helm.render(helm.helm_binaries()[0], LAYERINGS[render], sets)
    return yaml.safe_load(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])


class Routers:
    """Routers started from the chart's own router.yaml, pointed at engine URLs by
    ``PD_ROUTER__*`` overrides (as `make demo` and the observability tier do)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.stack = Stack(workdir)
        self.n = 0

    def start(
        self,
        prefill: list[str],
        decode: list[str],
        kind: str = "dense",
        env: dict[str, str] | None = None,
        sets: tuple[str, ...] = (),
        render: str = engines.RENDER,
        admitted: bool = True,
    ) -> Proc:
        """A router from ``render``'s router.yaml; ``prefill`` empty: a flexible layout's
        (its one pool is ``decode``). ``admitted``: returned once it has admitted every engine
        given (:func:`wait_admitted`); False where one is meant to be down."""
        self.n += 1
        name = f"router-{self.n}"
        config = self.workdir / f"{name}.yaml"
        config.write_text(yaml.safe_dump(chart_router_config(render, sets)))
        over = {
            "PD_ROUTER__LISTEN__HOST": "127.0.0.1",
            "PD_ROUTER__LISTEN__PORT": "0",
            "PD_ROUTER__HEALTH__INTERVALSECONDS": "1",
            **(
                {
                    "PD_ROUTER__POOLS__PREFILL__DISCOVERY": "static",
                    "PD_ROUTER__POOLS__PREFILL__STATIC": "[" + ",".join(prefill) + "]",
                }
                if prefill
                else {}
            ),
            "PD_ROUTER__POOLS__DECODE__DISCOVERY": "static",
            "PD_ROUTER__POOLS__DECODE__STATIC": "[" + ",".join(decode) + "]",
            # the chart's model.routerTokenizer: the served model's tokenizer.json
            "PD_ROUTER__MODEL__TOKENIZER": str(engines.model(kind) / "tokenizer.json"),
            # engines on one host publish KV events on ports of their own (engines.cpu_command)
            "PD_ROUTER__ROUTING__KVEVENTS__PORT": "0",
            "PD_ROUTER__ROUTING__KVEVENTS__REPLAYPORT": "0",
            **(env or {}),
        }
        router = self.stack.router(name, config, {**os.environ, **over})
        if admitted:
            wait_admitted(router, {"prefill": len(prefill), "decode": len(decode)})
        return router

    def mark(self) -> int:
        """Where the routers started from now on begin (for :meth:`stop_since`)."""
        return len(self.stack.procs)

    def stop_since(self, mark: int) -> None:
        """Stop what was started since ``mark``, newest first."""
        started, self.stack.procs[mark:] = self.stack.procs[mark:], []
        for p in reversed(started):
            with contextlib.suppress(Exception):  # one that will not stop does not keep the rest
                p.stop()

    def stop(self) -> None:
        self.stack.stop()


ADMIT_SECONDS = 120.0  # an engine's first request (the weights probe) takes seconds on a busy CPU


def admitted(router: Proc) -> dict[str, float]:
    """The router's healthy engines per pool whose revision and weights it has read: those it
    pairs (``pd_router_weight_set_endpoints``, "unknown" left out)."""
    out: dict[str, float] = {}
    for labels, v in engines.samples(engines.metrics_text(router.url()), "pd_router_weight_set_endpoints"):
        if "unknown" not in (labels["revision"], labels["weights"]):
            out[labels["pool"]] = out.get(labels["pool"], 0) + v
    return out


def wait_admitted(router: Proc, want: dict[str, int]) -> None:
    """Until ``router`` pairs ``want``'s engines per pool. A router writes its port after one
    round of checks, but a check or weights probe that ran past its timeout (an engine's first
    request, on a machine CI's other worker keeps busy) admits that engine a check later: a test
    asking at once would be served whole by the engine left, not by the route it asserts."""
    want = {pool: n for pool, n in want.items() if n}
    deadline = time.monotonic() + ADMIT_SECONDS
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        got = admitted(router)
        if all(got.get(pool, 0) == n for pool, n in want.items()):
            return
        time.sleep(0.2)  # polling the router's own health checks, with a deadline
    raise AssertionError(f"the router admitted {got}, not {want}:\n{router.log_tail()}")
