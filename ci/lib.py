"""What ci/ and tests/ share, each fact in one place:

- ROOT, CHART, and the tools: HELM4, HELM3 (scripts/tools.env, which scripts/install-tools.sh and
  the Makefile read too);
- KUBE_MIN, the oldest Kubernetes the chart supports (Chart.yaml `kubeVersion`);
- environments(), the ONE loader of the environment catalog (argocd/environments/*.yaml);
- helm_template() and helm_lint(), the ONE builder of each Helm command line;
- deep_merge(), Helm's layering of values (and Argo CD's templatePatch merge).

Run the ci modules from the repository root as `python -m ci.<name>`.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from ci import crd_schema

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "pd-inference"
CATALOG = "argocd/environments"  # relative to a checkout's root
TOOLS_ENV = ROOT / "scripts" / "tools.env"
RELEASE = "pd"


# --- tools ----------------------------------------------------------------------------------------


@functools.cache
def tools() -> dict[str, str]:
    """scripts/tools.env as a dict, ${KEY} expanded (the subset of shell that file keeps to)."""
    out: dict[str, str] = {}
    for n, line in enumerate(TOOLS_ENV.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(\S*)", line)
        if not m:
            raise SystemExit(f"{TOOLS_ENV.relative_to(ROOT)}:{n}: not KEY=VALUE: {line!r}")

        def expand(ref: re.Match[str], n: int = n) -> str:
            if ref.group(1) not in out:
                raise SystemExit(f"{TOOLS_ENV.relative_to(ROOT)}:{n}: ${{{ref.group(1)}}} is not defined above")
            return out[ref.group(1)]

        out[m.group(1)] = re.sub(r"\$\{([A-Z][A-Z0-9_]*)\}", expand, m.group(2))
    return out


HELM4 = ROOT / tools()["HELM4"]  # what Argo CD 3.5 embeds: the Helm every render and check uses
HELM3 = ROOT / tools()["HELM3"]
HELM = HELM4
PROMETHEUS_DIR = ROOT / tools()["PROMETHEUS_DIR"]
OTELCOL = ROOT / tools()["OTELCOL_DIR"] / "otelcol-pd"  # the OpenTelemetry Collector (install-tools)


def helm_binaries() -> list[Path]:
    """Helm 4, then Helm 3 (PD_HELM_BINARIES=path:path overrides, e.g. to try other builds)."""
    raw = os.environ.get("PD_HELM_BINARIES", "")
    paths = [Path(p) for p in raw.split(":") if p] or [HELM4, HELM3]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise RuntimeError(f"Helm not installed at {missing}: run `make helm` (or `make tools`)")
    return paths


# --- Kubernetes -----------------------------------------------------------------------------------


def _kube_min(chart: Path = CHART) -> str:
    constraint = str(yaml.safe_load((chart / "Chart.yaml").read_text()).get("kubeVersion", ""))
    m = re.fullmatch(r">=\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:-0)?", constraint.strip())
    if not m:
        raise SystemExit(f"{chart / 'Chart.yaml'}: kubeVersion {constraint!r} is not a '>=MAJOR.MINOR.PATCH-0' floor")
    return f"{m.group(1)}.{m.group(2)}.{m.group(3) or 0}"


# The oldest Kubernetes the chart supports ("MAJOR.MINOR.PATCH"): what Helm is told without a cluster
# (Helm 3 assumes 1.20 otherwise) and the oldest schema every object is validated against.
KUBE_MIN = _kube_min()
KUBE_MIN_MINOR = tuple(int(x) for x in KUBE_MIN.split(".")[:2])


def supported(version: str) -> bool:
    """A Kubernetes version ("1.31" or "1.31.4") the chart supports."""
    return tuple(int(x) for x in version.split(".")[:2]) >= KUBE_MIN_MINOR


def capabilities(kube_version: bool = True) -> list[str]:
    """What Argo CD passes from the target cluster; CI assumes the oldest supported Kubernetes with
    every CRD of ci/crds/ installed (Argo CD, the Prometheus Operator, KEDA: the environments'
    monitors, PrometheusRule and ScaledObject need them)."""
    apis = [arg for api in crd_schema.api_versions() for arg in ("--api-versions", api)]
    return (["--kube-version", KUBE_MIN] if kube_version else []) + apis


# --- the environment catalog ----------------------------------------------------------------------


class CatalogError(SystemExit):
    """A catalog file or a name that does not fit the catalog; the message says which and why."""


def environments(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """The environment catalog of a checkout, by name, sorted: argocd/environments/<name>.yaml,
    each with its `name` equal to the file's stem (Argo CD's Application is named after it)."""
    envs = {}
    for path in sorted((root / CATALOG).glob("*.yaml")):
        env = yaml.safe_load(path.read_text())
        if not isinstance(env, dict) or env.get("name") != path.stem:
            got = env.get("name") if isinstance(env, dict) else env
            raise CatalogError(f"{CATALOG}/{path.name}: name must be {path.stem!r} (the file's name), got {got!r}")
        envs[env["name"]] = env
    return envs


def environment(name: str, root: Path = ROOT) -> dict[str, Any]:
    """One catalog entry; an unknown name is an error that lists the catalog (and says when
    values/<name>.yaml exists but is no environment)."""
    envs = environments(root)
    if name in envs:
        return envs[name]
    have = ", ".join(envs) or "none"
    if (root / "values" / f"{name}.yaml").is_file():
        add = "" if "/" in name else f"add {CATALOG}/{name}.yaml to make it one, or "
        raise CatalogError(
            f"values/{name}.yaml is not an environment: the catalog ({CATALOG}/) has {have}; {add}render "
            f"the file itself with helm template {RELEASE} charts/pd-inference -f values/{name}.yaml"
        )
    raise CatalogError(f"no environment {name!r} in the catalog ({CATALOG}/): have {have}")


# --- Helm command lines ---------------------------------------------------------------------------


def helm_template(
    files: Iterable[str | Path] = (),
    sets: Iterable[str] = (),
    set_strings: Iterable[str] = (),
    *,
    helm: Path | str | None = None,
    release: str = RELEASE,
    chart: Path | str = CHART,
    namespace: str,
    root: Path = ROOT,
    api_versions: bool = True,
    include_crds: bool = False,
    skip_tests: bool = False,
    skip_crds: bool = False,
    extra: Iterable[str] = (),
) -> list[str]:
    """`helm template` for the chart: value files (relative ones from `root`) layered in order,
    then --set and --set-string; always the oldest supported Kubernetes (KUBE_MIN), and with
    `api_versions` the APIs of every CRD in ci/crds/ (what Argo CD passes from a cluster that has
    them). `helm` defaults to Helm 4."""
    args = [str(helm or HELM), "template", release, str(chart), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    args += value_flags(files, root)
    args += [a for s in sets for a in ("--set", s)]
    args += [a for s in set_strings for a in ("--set-string", s)]
    if skip_tests:
        args.append("--skip-tests")
    if skip_crds:
        args.append("--skip-crds")
    args += ["--kube-version", KUBE_MIN]
    if api_versions:
        args += capabilities(kube_version=False)
    return args + list(extra)


def helm_lint(
    files: Iterable[str | Path] = (), *, helm: Path | str | None = None, root: Path = ROOT, kube_version: str = ""
) -> list[str]:
    """`helm lint --strict` for the chart, against KUBE_MIN unless told another version. It takes
    no --api-versions: the custom resources render by crds.assumeInstalled."""
    args = [str(helm or HELM), "lint", "--strict", str(CHART), "--kube-version", kube_version or KUBE_MIN]
    return args + ["--set", "crds.assumeInstalled=true", *value_flags(files, root)]


def value_flags(files: Iterable[str | Path], root: Path = ROOT) -> list[str]:
    """`-f PATH` per value file, relative paths resolved from `root`."""
    return [a for f in files for a in ("-f", str(root / f))]


# --- values ---------------------------------------------------------------------------------------


def deep_merge(base: Any, patch: Any) -> Any:
    """Helm's layering of values files (and a strategic merge patch without list merge keys): maps
    merge, anything else is replaced, `null` removes the key. Neither argument is modified."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = deep_merge(base.get(k), v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(patch)
