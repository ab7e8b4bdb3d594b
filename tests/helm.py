"""Real Helm, called through subprocess: both pinned versions (scripts/tools.env, read by ci/lib.py).
The command lines come from ci/lib.py's builders, the ones CI uses."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ci import lib

ROOT = lib.ROOT
CHART = lib.CHART
VALUES = ROOT / "values"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion); Helm 3 assumes 1.20 without a cluster.
KUBE_VERSION = lib.KUBE_MIN
RELEASE = lib.RELEASE
NAMESPACE = "pd-test"


def helm_binaries() -> list[Path]:
    """Helm 4 (what Argo CD 3.5 embeds), then Helm 3."""
    return lib.helm_binaries()


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def docs(self) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.stdout) if d]


@functools.cache
def _run(args: tuple[str, ...]) -> Result:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def template(
    helm: Path,
    files: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    values_yaml: str | None = None,
    chart: Path = CHART,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    capabilities: bool = True,
) -> Result:
    """`helm template`; `values_yaml` is written to a temp file and layered last. With
    `capabilities`, the API versions Argo CD would pass from a cluster with every CRD of ci/crds/."""
    layers = [*files, *([_values_file(values_yaml)] if values_yaml is not None else [])]
    args = lib.helm_template(
        layers, sets, helm=helm, release=release, chart=chart, namespace=namespace, api_versions=capabilities
    )
    return _run(tuple(args) + extra)


@functools.cache
def _values_file(text: str) -> Path:
    import hashlib
    import tempfile

    # Per process: pytest-xdist workers render the same values at the same time.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"pd-values-{os.getpid()}-{digest}.yaml"
    path.write_text(text)
    return path


def lint(helm: Path, files: tuple[str, ...] = ()) -> Result:
    return _run(tuple(lib.helm_lint(files, helm=helm)))


def render(helm: Path, files: tuple[str, ...] = (), sets: tuple[str, ...] = (), **kw: Any) -> list[dict[str, Any]]:
    result = template(helm, files, sets, **kw)
    assert result.returncode == 0, result.stderr
    return result.docs


def find(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]


def one(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = find(docs, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]
