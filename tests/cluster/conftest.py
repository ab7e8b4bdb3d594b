"""The cluster tier's fixture: one real control plane per Kubernetes version .tools/kube.json
lists (newest and oldest the module proxy serves), shared by the tests of that version, which one
pytest-xdist worker runs in order (the `xdist_group` of each version)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import helm
from tests.cluster import controlplane, fleet


@pytest.fixture(
    scope="session",
    params=[pytest.param(v, marks=pytest.mark.xdist_group(f"cluster-{v}")) for v in controlplane.versions()],
)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[controlplane.ControlPlane]:
    version = request.param
    cp = controlplane.ControlPlane(version, tmp_path_factory.mktemp(f"kube-{version}")).start()
    try:
        cp.apply(fleet.crds())
        cp.wait_for_condition("crd", "Established")
        cp.start_lws()
        cp.apply(fleet.nodes())
        cp.wait_for_condition("node", "Ready")
        cp.apply(fleet.storage())
        # Pods need their namespace's default ServiceAccount, which the controller manager makes.
        cp.wait_until(
            "the default ServiceAccount", lambda: cp.kubectl("get", "sa", "default", check=False).returncode == 0
        )
        yield cp
    finally:
        cp.stop()


@pytest.fixture(params=helm.helm_binaries(), ids=lambda p: p.parent.name)
def helm_bin(request: pytest.FixtureRequest) -> Path:
    """Each pinned Helm in turn, for the tests that install with both."""
    return request.param
