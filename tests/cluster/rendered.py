"""What the chart renders for the cluster tests: an environment as its Argo CD Application renders
it (ci/gitops.py), or a layering rendered directly."""

from __future__ import annotations

import copy
import functools
from typing import Any

import yaml

from ci import gitops
from tests import helm

LEVELS = ("restricted", "baseline", "privileged")  # Pod Security Standards, strictest first


@functools.cache
def environment(env: str) -> tuple[dict[str, Any], ...]:
    """The environment's objects as Argo CD applies them (its Application's helm template)."""
    import subprocess

    args = gitops.helm_command(gitops.environment_application(env), helm.helm_binaries()[0])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=helm.ROOT, check=True)
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def pod_of(workload: dict[str, Any], namespace: str) -> dict[str, Any]:
    """A bare Pod with the workload's pod template, for admission checks (no ServiceAccount: Pod
    Security does not look at it, and the namespace has none)."""
    spec = copy.deepcopy(workload["spec"]["template"]["spec"])
    spec.pop("serviceAccountName", None)
    for claim in workload["spec"].get("volumeClaimTemplates", []):  # what the StatefulSet controller adds
        name = claim["metadata"]["name"]
        spec.setdefault("volumes", []).append({"name": name, "persistentVolumeClaim": {"claimName": f"{name}-x-0"}})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"pss-{workload['metadata']['name'][-40:]}", "namespace": namespace},
        "spec": spec,
    }
