"""Upgrade safety: fields Kubernetes will not update in place must not change without a major bump.

A StatefulSet's selector, serviceName, volumeClaimTemplates and podManagementPolicy, and a
Deployment's selector, are immutable: changing one makes `helm upgrade` and every Argo CD sync fail
("spec: Forbidden: updates to statefulset spec for fields other than ..."), and the only way out is
deleting the object. So such a change needs a new major chart version (and upgrade notes).

This renders every environment with an earlier chart (from git: `git archive REV`, its own values
files) and with the working tree, and compares those fields object by object (same kind and name).

Earlier charts compared (tests/test_upgrade_safety.py does the same):
- the previous chart *version*: the newest commit whose Chart.yaml version differs from the current;
- the base: $BASE_REF, else the merge base with origin/main, else the last release tag
  (ci/version_bump.py), else HEAD~1.

    python -m ci.upgrade_safety [--helm PATH] [REV ...]   # default: the two above (whichever exist)
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ci import lib, version_bump

ROOT = lib.ROOT
CHART = "charts/pd-inference"
HELM = lib.HELM
IMMUTABLE = {
    "StatefulSet": ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy"),
    "Deployment": ("selector",),
}
# Kubernetes' defaults, so "absent" and "the default spelled out" compare equal.
DEFAULTS = {("StatefulSet", "podManagementPolicy"): "OrderedReady", ("StatefulSet", "volumeClaimTemplates"): []}


def immutable_fields(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for doc in docs:
        fields = IMMUTABLE.get(doc.get("kind", ""))
        if not fields:
            continue
        spec = doc.get("spec", {})
        out[(doc["kind"], doc["metadata"]["name"])] = {f: spec.get(f, DEFAULTS.get((doc["kind"], f))) for f in fields}
    return out


def immutable_changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """Each immutable field that differs on an object present in both renders."""
    old, new = immutable_fields(before), immutable_fields(after)
    changes = []
    for key in sorted(old.keys() & new.keys()):
        for field, value in old[key].items():
            if new[key][field] != value:
                changes.append(
                    f"{key[0]}/{key[1]}: spec.{field} changed from {json.dumps(value, sort_keys=True)} "
                    f"to {json.dumps(new[key][field], sort_keys=True)}"
                )
    return changes


def verdict(changes: list[str], old_version: str, new_version: str) -> list[str]:
    """Failures: immutable changes are allowed only with a higher major version."""
    if not changes:
        return []
    old_major, new_major = int(old_version.split(".")[0]), int(new_version.split(".")[0])
    if new_major > old_major:
        return []
    return [
        f"{c} — Kubernetes cannot apply this in place (helm upgrade and Argo CD sync would fail); "
        f"bump the chart's major version ({old_version} -> {old_major + 1}.0.0) and document the migration"
        for c in changes
    ]


def chart_version(chart_yaml: str) -> str:
    return str(yaml.safe_load(chart_yaml)["version"])


def extract(rev: str, dest: Path, repo: Path = ROOT) -> None:
    """The chart, values/ and the environments catalog as they were at `rev`."""
    paths = [p for p in (CHART, "values", "argocd/environments") if _exists_at(rev, p, repo)]
    data = subprocess.run(["git", "archive", "--format=tar", rev, *paths], cwd=repo, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(data.stdout)) as tar:
        tar.extractall(dest, filter="data")


def _exists_at(rev: str, path: str, repo: Path) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=repo, capture_output=True).returncode == 0


def render_env(root: Path, env: dict[str, Any], helm: Path = HELM) -> list[dict[str, Any]]:
    args = lib.helm_template(
        env["valueFiles"], helm=helm, chart=root / CHART, namespace=env["namespace"], root=root, skip_tests=True
    )
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"helm template ({root}): {proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def previous_version_rev(repo: Path = ROOT) -> str | None:
    """The newest commit whose Chart.yaml version differs from the working tree's."""
    current = chart_version((repo / CHART / "Chart.yaml").read_text())
    # HEAD first: the working tree bumped the version, so HEAD itself is the previous version
    # (a commit that merely touched Chart.yaml earlier may be an inconsistent middle state).
    head = subprocess.run(["git", "show", f"HEAD:{CHART}/Chart.yaml"], cwd=repo, capture_output=True, text=True)
    if head.returncode == 0 and chart_version(head.stdout) != current:
        return "HEAD"
    revs = subprocess.run(
        ["git", "rev-list", "HEAD", "--", f"{CHART}/Chart.yaml"], cwd=repo, capture_output=True, text=True
    ).stdout.split()
    for rev in revs:
        for candidate in (rev, f"{rev}~1"):
            shown = subprocess.run(
                ["git", "show", f"{candidate}:{CHART}/Chart.yaml"], cwd=repo, capture_output=True, text=True
            )
            if shown.returncode == 0 and chart_version(shown.stdout) != current:
                return candidate
    return None


def default_revs(repo: Path = ROOT) -> dict[str, str]:
    revs = {}
    prev = previous_version_rev(repo)
    if prev:
        revs[f"previous chart version ({prev[:12]})"] = prev
    base, why = version_bump.pick_base(repo, dict(os.environ))
    if base is None and version_bump._commit(repo, "HEAD~1"):
        # Nothing released yet: still guard the last commit, immutable fields included.
        base, why = "HEAD~1", "HEAD~1 (nothing released yet)"
    if base and _exists_at(base, f"{CHART}/Chart.yaml", repo):
        revs[f"base: {why}"] = base
    return revs


def check_rev(rev: str, repo: Path = ROOT, helm: Path = HELM) -> list[str]:
    current = lib.environments(repo)
    new_version = chart_version((repo / CHART / "Chart.yaml").read_text())
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        old_root = Path(tmp)
        extract(rev, old_root, repo)
        old_version = chart_version((old_root / CHART / "Chart.yaml").read_text())
        old_envs = lib.environments(old_root) if (old_root / lib.CATALOG).is_dir() else {}
        for name, env in current.items():
            old_env = old_envs.get(name, env)
            if not all((old_root / f).is_file() for f in old_env["valueFiles"]):
                old_env, old_root_for_values = env, repo  # values layout changed: old chart, today's values
            else:
                old_root_for_values = old_root
            before = render_env_mixed(old_root, old_root_for_values, old_env, helm)
            after = render_env(repo, env, helm)
            failures += [f"{name}: {f}" for f in verdict(immutable_changes(before, after), old_version, new_version)]
    return failures


def render_env_mixed(chart_root: Path, values_root: Path, env: dict[str, Any], helm: Path) -> list[dict[str, Any]]:
    if chart_root == values_root:
        return render_env(chart_root, env, helm)
    env = dict(env, valueFiles=[str(values_root / f) for f in env["valueFiles"]])
    return render_env(chart_root, env, helm)


def main(argv: list[str]) -> int:
    helm = HELM
    if argv[:1] == ["--helm"]:
        helm, argv = Path(argv[1]), argv[2:]
    revs = {r: r for r in argv} if argv else default_revs()
    if not revs:
        print("skipped: no earlier chart in git history to compare with (single commit or shallow clone)")
        return 0
    failed = False
    for label, rev in revs.items():
        failures = check_rev(rev, helm=helm)
        for f in failures:
            print(f"FAILED against {label}: {f}", file=sys.stderr)
        failed |= bool(failures)
        if not failures:
            print(f"ok: no immutable StatefulSet/Deployment field changed against {label} without a major bump")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
