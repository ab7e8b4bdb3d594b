"""What the chart renders for the engines, collected for the real-engine checks: every LMCache
config (ConfigMap `lmcache.yaml` plus the container's LMCACHE_* env) and every engine command
line (`vllm serve` arguments plus VLLM_* env), over every layering the chart tests render."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from tests import helm, manifests
from tests.cases import LAYERINGS, LMCACHE

FORCE_LMCACHE = (
    "kvTransfer.connector=lmcache",
    "kvTransfer.nixl.lmcacheMp.enabled=false",  # LMCache's MP mode rides on NIXL (the chart refuses it on lmcache)
    "router.replicas=1",
    "router.autoscaling.enabled=false",
)


@functools.cache
def lmcache_refusal(files: tuple[str, ...], sets: tuple[str, ...] = ()) -> str:
    """Why the chart refuses this layering on LMCache ("" when it accepts it)."""
    result = helm.template(helm.helm_binaries()[0], files, sets + FORCE_LMCACHE)
    return result.stderr if result.returncode != 0 else ""


def chart_says_hybrid(files: tuple[str, ...], sets: tuple[str, ...] = ()) -> bool:
    """The chart's own judgement: it refuses this layering on LMCache because the model is hybrid."""
    return "kvTransfer.connector: lmcache cannot serve" in lmcache_refusal(files, sets)


def chart_says_multi_node(files: tuple[str, ...]) -> bool:
    """... or because its engines span nodes (LMCache PD serves one-node engines only)."""
    return "kvTransfer.connector lmcache serves one-node engines" in lmcache_refusal(files)


def chart_says_lora(files: tuple[str, ...]) -> bool:
    """... or because it serves LoRA adapters (LMCache's cache key leaves the adapter out)."""
    return "lmcache cannot serve LoRA adapters" in lmcache_refusal(files)


# Every layering switched to LMCache where the chart accepts that (not for a hybrid model,
# multi-node engines or LoRA adapters), plus the LMCache shapes no environment uses yet: TP 4, the notification
# sidecar, extraConfig.
LMCACHE_RENDERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    f"{name} (lmcache)": (files, FORCE_LMCACHE)
    for name, files in LAYERINGS.items()
    if not chart_says_hybrid(files) and not chart_says_multi_node(files) and not chart_says_lora(files)
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
# ... and the dev environment serving LoRA adapters (tests/real_engine/test_real_lora.py), their
# paths under tests/real_engine/engines.LORA_MOUNT: both adapters, and the first alone (an engine
# of a rollout that adds the second, not yet replaced).
LORA_ADAPTERS = ("sql-expert", "support-bot")


def lora_sets(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(
        f"model.lora.adapters[{i}].{key}"
        for i, name in enumerate(names)
        for key in (f"name={name}", "rank=8", f"path=/models/adapters/{name}")
    )


# ... and the dev environment with LMCache's MP mode beside NIXL (tests/real_engine/
# test_real_lmcache_mp.py), its model declared full-attention: the tier serves the tiny dense
# model (the chart refuses LMCache's MP mode for the profile's hybrid Qwen3.5).
REAL_ONLY_RENDERS["env:dev lmcache-mp"] = (
    (*LAYERINGS["env:dev"], "tests/values/lmcache-mp.yaml"),
    ("model.attention=full",),
)
REAL_ONLY_RENDERS["env:dev lora"] = (LAYERINGS["env:dev"], lora_sets(LORA_ADAPTERS))
REAL_ONLY_RENDERS["env:dev lora one"] = (LAYERINGS["env:dev"], lora_sets(LORA_ADAPTERS[:1]))
# Adapters from both sources, for vLLM's own parsers (tests/engines/test_engine_vllm_cli.py).
ENGINE_RENDERS["scenario:lora adapters"] = (
    LAYERINGS["env:dev"],
    (
        *lora_sets(LORA_ADAPTERS),
        "model.lora.adapters[2].name=acme/support-v2",
        "model.lora.adapters[2].rank=64",
        "model.lora.adapters[2].hub.id=acme/support-lora",
        f"model.lora.adapters[2].hub.revision={'3' * 40}",
        "model.lora.maxLoras=2",
    ),
)
# Multi-node shapes no values file uses (the Llama 3.1 405B profile is tensor parallel across two
# nodes): data + expert parallel decode of a mixture-of-experts model across two nodes, and a
# one-node engine of two data-parallel ranks.
MULTI_NODE = "values/profiles/llama-3.1-405b-p5x2.yaml"
ENGINE_RENDERS["scenario:dp+ep over two nodes"] = (
    (MULTI_NODE,),
    (
        "model.name=mistralai/Mixtral-8x7B-Instruct-v0.1",  # experts to parallelise (vLLM refuses EP without)
        "model.servedName=mixtral-8x7b",
        *(
            f"{role}.{key}"
            for role in ("prefill", "decode")
            for key in ("tensorParallelSize=1", "dataParallelSize=16", "expertParallel=true")
        ),
        "engine.kvEvents.enabled=false",
    ),
)
ENGINE_RENDERS["scenario:dp one node"] = (
    (MULTI_NODE,),
    ("prefill.nodes=1", "prefill.tensorParallelSize=4", "prefill.dataParallelSize=2", "engine.kvEvents.enabled=false"),
)
# What LeaderWorkerSet's pod webhook (v0.9.0) and the kubelet fill in: the container's $(VAR)s
# expanded as Kubernetes does, for the worker of group 0.
LWS_ENV = {
    "LWS_LEADER_ADDRESS": "pd-role-lws-0.pd-role-lws.pd-test",
    "LWS_WORKER_INDEX": "1",
    "POD_IP": "10.0.0.7",
}


def expand(value: str) -> str:
    for name, v in LWS_ENV.items():
        value = value.replace(f"$({name})", v)
    return value


@dataclass(frozen=True)
class Engine:
    """One engine container as rendered."""

    render: str
    role: str
    member: str  # "single" (a StatefulSet's pod), or a LeaderWorkerSet group's "leader" or "worker"
    hybrid: bool  # the chart refuses this render's values on LMCache: a hybrid model
    command: list[str]  # what the container runs after the preflight: ["vllm", "serve"]
    preflight: list[str]  # the preflight before it: [python, preflight.py, options...] ([] when off)
    args: list[str]
    env: dict[str, str]  # literal env values (valueFrom entries left out)
    tp: int
    lmcache_yaml: str | None
    # the pod's LMCache MP server (kvTransfer.nixl.lmcacheMp): its container's command + args, env
    lmcache_server: list[str] | None = None
    lmcache_server_env: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.render} {self.role}" + ("" if self.member == "single" else f" {self.member}")

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
    for role in manifests.engine_roles(docs):  # both, or the one pool of engine.layout flexible
        cms = helm.find(docs, "ConfigMap", f"-{role}-lmcache")
        for member, pod in pod_templates(docs, role):
            c = pod["spec"]["containers"][0]
            cut = c["command"].index("--") if "--" in c["command"] else -1
            args = [expand(a) for a in c["args"]]
            out.append(
                Engine(
                    render=render,
                    role=role,
                    member=member,
                    hybrid=chart_says_hybrid(files, sets),
                    command=c["command"][cut + 1 :],
                    preflight=c["command"][:cut] if cut >= 0 else [],
                    args=args,
                    env={e["name"]: expand(e["value"]) for e in c.get("env", []) if "value" in e},
                    tp=int(next(a for a in args if a.startswith("--tensor-parallel-size=")).split("=")[1]),
                    lmcache_yaml=cms[0]["data"]["lmcache.yaml"] if cms else None,
                    lmcache_server=next(
                        (
                            [*s["command"], *s["args"]]
                            for s in pod["spec"]["containers"]
                            if s["name"] == "lmcache-server"
                        ),
                        None,
                    ),
                    lmcache_server_env=tuple(
                        (v["name"], v["value"])
                        for s in pod["spec"]["containers"]
                        if s["name"] == "lmcache-server"
                        for v in s.get("env", [])
                    ),
                )
            )
    return tuple(out)


def pod_templates(docs: list[dict[str, Any]], role: str) -> list[tuple[str, dict[str, Any]]]:
    """A role's engine pod templates: its StatefulSet's, or its LeaderWorkerSet's leader and worker."""
    groups = helm.find(docs, "LeaderWorkerSet", f"-{role}-lws")
    if groups:
        lwt = groups[0]["spec"]["leaderWorkerTemplate"]
        return [("leader", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]
    return [("single", helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"])]


def all_engines(renders: dict[str, Any] = ENGINE_RENDERS) -> list[Engine]:
    return [e for r in renders for e in engines(r)]
