"""What the cluster tests share about the releases they install: the Pod Security level each
layering needs, namespace-safe Helm names, and pods grouped by component."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ci import lib

# The Pod Security level each environment's namespace needs (docs/operating.md "Pod Security"): the EFA
# engines add IPC_LOCK and prod caches weights on a hostPath, which only `privileged` allows; the
# chart defaults (no EFA, emptyDir) run under `restricted`, router and all.
POD_SECURITY = {"defaults": "restricted", "dev": "privileged", "staging": "privileged", "prod": "privileged"}


def layerings() -> dict[str, tuple[str, ...]]:
    """The chart defaults and each environment of the catalog: name -> its value files."""
    return {"defaults": (), **{name: tuple(env["valueFiles"]) for name, env in lib.environments().items()}}


def names(binary: Path) -> str:
    """A Helm binary's directory as a DNS label part: helm-vX.Y.Z -> helm-vX-Y-Z."""
    return binary.parent.name.replace(".", "-")


def by_component(pods: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for p in pods:
        out.setdefault(p["metadata"]["labels"].get("app.kubernetes.io/component", ""), []).append(p)
    return out
