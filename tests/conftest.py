from __future__ import annotations

from pathlib import Path

import pytest

from tests import helm


@pytest.fixture(params=helm.helm_binaries(), ids=lambda p: p.parent.name)
def any_helm(request: pytest.FixtureRequest) -> Path:
    """Each pinned Helm version in turn."""
    return request.param


@pytest.fixture
def h4() -> Path:
    """Helm 4 (what Argo CD 3.5 embeds), for assertions on rendered content."""
    return helm.helm_binaries()[0]
