"""Real Helm, called through subprocess. Both pinned versions (Makefile: PD_HELM_BINARIES)."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ci import gitops

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "pd-inference"
VALUES = ROOT / "values"
# Helm 3 assumes Kubernetes 1.20 without a cluster; the chart needs >= 1.29.
KUBE_VERSION = "1.29.0"
RELEASE = "pd"
NAMESPACE = "pd-test"


def helm_binaries() -> list[Path]:
    raw = os.environ.get("PD_HELM_BINARIES", "")
    paths = [Path(p) for p in raw.split(":") if p] or [
        ROOT / ".tools" / "helm-v4.2.1" / "helm",
        ROOT / ".tools" / "helm-v3.21.4" / "helm",
    ]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise RuntimeError(f"Helm not installed at {missing}: run `make tools`")
    return paths


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
    args = [str(helm), "template", release, str(chart), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    if capabilities:
        args += gitops.CLUSTER_CAPABILITIES[2:]
    for f in files:
        args += ["-f", str(ROOT / f)]
    if values_yaml is not None:
        path = _values_file(values_yaml)
        args += ["-f", str(path)]
    for s in sets:
        args += ["--set", s]
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
    # helm lint takes no --api-versions: it renders the custom resources by crds.assumeInstalled.
    args = [
        str(helm),
        "lint",
        "--strict",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "crds.assumeInstalled=true",
    ]
    for f in files:
        args += ["-f", str(ROOT / f)]
    return _run(tuple(args))


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
