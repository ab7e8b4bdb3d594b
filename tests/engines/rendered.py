"""What the chart renders for the engines, collected for the real-engine checks: every LMCache
config (ConfigMap `lmcache.yaml` plus the container's LMCACHE_* env) and every engine command
line (`vllm serve` arguments plus VLLM_* env), over every layering the chart tests render."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from tests import helm
from tests.cases import LAYERINGS, LMCACHE

FORCE_LMCACHE = ("kvTransfer.connector=lmcache", "router.replicas=1", "router.autoscaling.enabled=false")


@functools.cache
def chart_says_hybrid(files: tuple[str, ...], sets: tuple[str, ...] = ()) -> bool:
    """The chart's own judgement: it refuses this layering on LMCache because the model is hybrid."""
    result = helm.template(helm.helm_binaries()[0], files, sets + FORCE_LMCACHE)
    return result.returncode != 0 and "kvTransfer.connector: lmcache cannot serve" in result.stderr


# Every layering switched to LMCache where the chart accepts that (not for a hybrid model), plus
# the LMCache shapes no environment uses yet: TP 4, the notification sidecar, extraConfig.
LMCACHE_RENDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    f"{name} (lmcache)": (files, FORCE_LMCACHE) for name, files in LAYERINGS.items() if not chart_says_hybrid(files)
}
LMCACHE_RENDERS["scenario:lmcache tp4"] = ((LMCACHE,), ("prefill.tensorParallelSize=4", "decode.tensorParallelSize=4"))
LMCACHE_RENDERS["scenario:lmcache sidecar"] = ((LMCACHE,), ("kvTransfer.lmcache.notificationReceiver=prefillSidecar",))
LMCACHE_RENDERS["scenario:lmcache extraConfig"] = (
    (LMCACHE,),
    (
        "kvTransfer.lmcache.extraConfig.pd_allocation_timeout_sec=60",
        "kvTransfer.lmcache.extraConfig.pd_backend_mode=sync",
    ),
)
# The engine command lines: every layering as it is, and every LMCache render.
ENGINE_RENDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    **{name: (files, ()) for name, files in LAYERINGS.items()},
    **LMCACHE_RENDERS,
}
ROLES = ("prefill", "decode")
# Renders only the real-engine tier runs (tests/real_engine/test_real_revision.py): the dev
# environment at two model revisions, one KV revision each.
REVISIONS = ("1" * 40, "2" * 40)
REAL_ONLY_RENDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    f"env:dev revision {i}": (LAYERINGS["env:dev"], (f"model.revision={rev}",)) for i, rev in enumerate(REVISIONS)
}
# ... and the dev environment with tracing on (tests/real_engine/test_real_tracing.py): the router
# and both engines export to a collector (its address here a placeholder the tier replaces).
TRACING_SETS = ("tracing.endpoint=http://otel-collector.observability.svc:4317",)
REAL_ONLY_RENDERS["env:dev traced"] = (LAYERINGS["env:dev"], TRACING_SETS)


@dataclass(frozen=True)
class Engine:
    """One engine container as rendered."""

    render: str
    role: str
    hybrid: bool  # the chart refuses this render's values on LMCache: a hybrid model
    command: list[str]  # what the container runs after the preflight: ["vllm", "serve"]
    preflight: list[str]  # the preflight before it: [python, preflight.py, options...] ([] when off)
    args: list[str]
    env: dict[str, str]  # literal env values (valueFrom entries left out)
    tp: int
    lmcache_yaml: str | None

    @property
    def name(self) -> str:
        return f"{self.render} {self.role}"

    @property
    def kv_transfer_config(self) -> dict[str, Any]:
        return json.loads(self.args[self.args.index("--kv-transfer-config") + 1])

    @property
    def kv_events_config(self) -> dict[str, Any] | None:
        """``--kv-events-config``'s JSON (engine.kvEvents), or None when it is not rendered."""
        if "--kv-events-config" not in self.args:
            return None
        return json.loads(self.args[self.args.index("--kv-events-config") + 1])

    @property
    def served_names(self) -> list[str]:
        """``--served-model-name``'s values: the served name, then its KV revision's."""
        i = self.args.index("--served-model-name") + 1
        j = next((k for k in range(i, len(self.args)) if self.args[k].startswith("-")), len(self.args))
        return self.args[i:j]


@functools.cache
def engines(render: str) -> tuple[Engine, ...]:
    files, sets = {**ENGINE_RENDERS, **REAL_ONLY_RENDERS}[render]
    docs = helm.render(helm.helm_binaries()[0], files, sets)
    out = []
    for role in ROLES:
        sts = helm.one(docs, "StatefulSet", f"-{role}")
        c = sts["spec"]["template"]["spec"]["containers"][0]
        cut = c["command"].index("--") if "--" in c["command"] else -1
        command = c["command"][cut + 1 :]
        cms = helm.find(docs, "ConfigMap", f"-{role}-lmcache")
        out.append(
            Engine(
                render=render,
                role=role,
                hybrid=chart_says_hybrid(files, sets),
                command=command,
                preflight=c["command"][:cut] if cut >= 0 else [],
                args=list(c["args"]),
                env={e["name"]: e["value"] for e in c.get("env", []) if "value" in e},
                tp=int(next(a for a in c["args"] if a.startswith("--tensor-parallel-size=")).split("=")[1]),
                lmcache_yaml=cms[0]["data"]["lmcache.yaml"] if cms else None,
            )
        )
    return tuple(out)


def all_engines(renders: dict[str, Any] = ENGINE_RENDERS) -> list[Engine]:
    return [e for r in renders for e in engines(r)]
