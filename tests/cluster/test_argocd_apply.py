"""argocd/ applied as `kubectl apply -k` applies it (server-side, strict field validation), and the
Applications its ApplicationSet would generate (as ci/gitops.py renders them), to the real API
server with the Argo CD 3.5.1 CRDs."""

from __future__ import annotations

import copy

import yaml

from ci import gitops
from tests import helm
from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane


def test_kubectl_apply_k_argocd_server_side_strict(cluster: ControlPlane) -> None:
    cluster.apply([fleet.namespace("argocd", "restricted")])
    proc = cluster.kubectl(
        "apply", "-k", str(helm.ROOT / "argocd"), "--server-side", "--field-manager=pd-tests", "--validate=strict"
    )
    applied = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    # What kustomize built here is what ci/gitops.py's subset builds (it is what the tests check).
    expected = {f"{d['kind'].lower()}.argoproj.io/{d['metadata']['name']}" for d in gitops.kustomize_build()}
    assert applied == expected, proc.stdout
    built = yaml.safe_load_all(cluster.kubectl("kustomize", str(helm.ROOT / "argocd")).stdout)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built if d) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in gitops.kustomize_build()
    )


def test_generated_applications_are_accepted_and_a_bad_one_is_not(cluster: ControlPlane) -> None:
    cluster.apply([fleet.namespace("argocd", "restricted")])
    apps = list(gitops.environment_applications().values())
    assert len(apps) == 3
    proc = cluster.apply(apps)
    assert proc.stdout.count("serverside-applied") == 3, proc.stdout
    stored = {a["metadata"]["name"] for a in cluster.get("applications.argoproj.io", "-n", "argocd")["items"]}
    assert {a["metadata"]["name"] for a in apps} <= stored
    bad = copy.deepcopy(apps[0])
    bad["spec"]["syncPolicy"]["automatedd"] = {}
    proc = cluster.apply([bad], "--dry-run=server", check=False)
    assert proc.returncode != 0 and "automatedd" in proc.stderr, proc.stderr
