"""Routers in front of real engines, configured from the chart's own router.yaml: the
real-engine tier's (tests/real_engine/conftest.py) and ``make demo-real``'s
(tests/real_engine/demo.py), one place for both."""

from __future__ import annotations

import contextlib
import os
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
    ) -> Proc:
        """A router from ``render``'s router.yaml; ``prefill`` empty: a flexible layout's
        (its one pool is ``decode``)."""
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
        return self.stack.router(name, config, {**os.environ, **over})

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
