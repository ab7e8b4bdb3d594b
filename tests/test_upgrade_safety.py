"""Upgrade safety (ci/upgrade_safety.py): an immutable StatefulSet/Deployment field must not change
without a major chart version bump, against the previous chart version and the base in git, and
the comparator itself on synthetic manifests and on a throwaway git repository."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ci import upgrade_safety as us
from tests import helm

pytestmark = pytest.mark.xdist_group("upgrade")


def sts(**spec: Any) -> dict[str, Any]:
    base = {
        "selector": {"matchLabels": {"app.kubernetes.io/component": "decode"}},
        "serviceName": "pd-decode",
        "replicas": 1,
        "template": {"metadata": {"labels": {"a": "b"}}},
        "volumeClaimTemplates": [
            {"metadata": {"name": "cache"}, "spec": {"resources": {"requests": {"storage": "1Gi"}}}}
        ],
    }
    base.update(spec)
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "pd-decode"}, "spec": base}


def deploy(selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "pd-router"},
        "spec": {"selector": {"matchLabels": selector}, "replicas": 1},
    }


CHANGES = {
    "selector": sts(selector={"matchLabels": {"app.kubernetes.io/component": "decoder"}}),
    "serviceName": sts(serviceName="pd-decode-headless"),
    "volumeClaimTemplates": sts(
        volumeClaimTemplates=[{"metadata": {"name": "cache"}, "spec": {"resources": {"requests": {"storage": "2Gi"}}}}]
    ),
    "podManagementPolicy": sts(podManagementPolicy="Parallel"),
}


@pytest.mark.parametrize("field", CHANGES)
def test_statefulset_immutable_change_needs_a_major_bump(field: str) -> None:
    changes = us.immutable_changes([sts()], [CHANGES[field]])
    assert len(changes) == 1 and f"spec.{field}" in changes[0] and "StatefulSet/pd-decode" in changes[0]
    failures = us.verdict(changes, "0.1.0", "0.2.0")
    assert failures and "1.0.0" in failures[0]
    assert us.verdict(changes, "0.1.0", "0.1.0")
    assert us.verdict(changes, "1.4.2", "2.0.0") == []


def test_deployment_selector_change_needs_a_major_bump() -> None:
    changes = us.immutable_changes([deploy({"c": "router"})], [deploy({"c": "router", "v": "2"})])
    assert changes and "Deployment/pd-router: spec.selector" in changes[0]
    assert us.verdict(changes, "0.1.0", "0.1.1")
    assert us.verdict(changes, "0.1.0", "1.0.0") == []


def test_mutable_changes_and_renames_pass() -> None:
    after = sts(replicas=4, template={"metadata": {"labels": {"a": "c"}}})
    assert us.immutable_changes([sts(), deploy({"c": "r"})], [after, deploy({"c": "r"})]) == []
    renamed = copy.deepcopy(CHANGES["selector"])
    renamed["metadata"]["name"] = "pd-decode-v2"  # a new object: created, the old one pruned
    assert us.immutable_changes([sts()], [renamed]) == []


def test_defaults_compare_equal_to_absent() -> None:
    assert us.immutable_changes([sts()], [sts(podManagementPolicy="OrderedReady")]) == []
    no_vct = sts()
    del no_vct["spec"]["volumeClaimTemplates"]
    assert us.immutable_changes([no_vct], [sts(volumeClaimTemplates=[])]) == []


def test_chart_against_earlier_versions_in_git() -> None:
    """The real check: the previous chart version and the base (whichever git history has)."""
    revs = us.default_revs()
    if not revs:
        pytest.skip("no earlier chart in git history (single commit or shallow clone); comparator tested above")
    helm4 = helm.helm_binaries()[0]
    failures = [f"{label}: {f}" for label, rev in revs.items() for f in us.check_rev(rev, helm=helm4)]
    assert not failures, "\n".join(failures)


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    proc = subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, env={**env, "PATH": "/usr/bin:/bin"}
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_end_to_end_on_a_throwaway_repository(tmp_path: Path) -> None:
    """Copy the chart into a new git repo, change the decode StatefulSet's serviceName in a commit:
    fails without a major bump, passes with one."""
    repo = tmp_path / "repo"
    for sub in ("charts/pd-inference", "values", "argocd/environments"):
        shutil.copytree(helm.ROOT / sub, repo / sub)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    chart_yaml = repo / "charts/pd-inference/Chart.yaml"
    version = us.chart_version(chart_yaml.read_text())
    major, minor = (int(x) for x in version.split(".")[:2])
    _git(repo, "commit", "-qm", f"chart {version}")
    sts_tpl = repo / "charts/pd-inference/templates/engine/statefulset.yaml"
    text = sts_tpl.read_text()
    assert "serviceName:" in text
    sts_tpl.write_text(text.replace("serviceName: ", "serviceName: renamed-", 1))
    minor_bump = f"{major}.{minor + 1}.0"
    chart_yaml.write_text(chart_yaml.read_text().replace(f"\nversion: {version}", f"\nversion: {minor_bump}"))
    _git(repo, "commit", "-qam", "rename headless services (minor bump only)")
    helm4 = helm.helm_binaries()[0]
    failures = us.check_rev("HEAD~1", repo=repo, helm=helm4)
    assert failures and all("spec.serviceName" in f and f"{major + 1}.0.0" in f for f in failures), failures
    assert {f.split(":")[0] for f in failures} == {"dev", "staging", "prod"}
    assert us.previous_version_rev(repo) is not None
    chart_yaml.write_text(chart_yaml.read_text().replace(f"\nversion: {minor_bump}", f"\nversion: {major + 1}.0.0"))
    assert us.check_rev("HEAD~1", repo=repo, helm=helm4) == []
