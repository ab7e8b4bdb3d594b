"""Every values file and environment layering renders with both Helm versions, passes
`helm lint --strict`, and every object validates against Kubernetes 1.29 .. newest schemas."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions

from ci import crd_schema
from tests import helm
from tests.cases import LAYERINGS, VALUES_FILES

KUBE_VERSIONS = [v for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 29)]


def test_kubernetes_versions_cover_the_supported_range() -> None:
    assert KUBE_VERSIONS[0].startswith("1.29.")
    assert len(KUBE_VERSIONS) >= 8, KUBE_VERSIONS


@pytest.mark.parametrize("name", LAYERINGS)
def test_renders_and_lints(any_helm: Path, name: str) -> None:
    files = LAYERINGS[name]
    result = helm.template(any_helm, files)
    assert result.returncode == 0, result.stderr
    kinds = {d["kind"] for d in result.docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy"} <= kinds
    lint = helm.lint(any_helm, files)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "[WARNING]" not in lint.stdout


@pytest.mark.parametrize("name", LAYERINGS)
def test_helm3_and_helm4_render_the_same(name: str) -> None:
    h4, h3 = helm.helm_binaries()[:2]
    assert helm.template(h4, LAYERINGS[name]).docs == helm.template(h3, LAYERINGS[name]).docs


@pytest.mark.parametrize("name", LAYERINGS)
def test_objects_validate_against_kubernetes_schemas(h4: Path, name: str) -> None:
    docs = helm.render(h4, LAYERINGS[name], extra=("--api-versions", "monitoring.coreos.com/v1"))
    errors = []
    for doc in docs:
        if crd_schema.is_custom_resource(doc):
            errors += crd_schema.validate(doc)  # against the operator's CRD (ci/crds/)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{version} {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)


def test_every_values_file_is_covered() -> None:
    assert {"values/dev.yaml", "values/staging.yaml", "values/prod.yaml"} <= set(VALUES_FILES)
    assert any("llama-3.3-70b-p5" in f for f in VALUES_FILES)
    assert any("qwen3.5-9b-g6" in f for f in VALUES_FILES)


def test_unknown_key_fails_and_names_it(any_helm: Path) -> None:
    result = helm.template(any_helm, sets=("prefill.replicsa=2",))
    assert result.returncode != 0
    assert "replicsa" in result.stderr and "/prefill" in result.stderr


def test_schema_is_packaged(tmp_path: Path, any_helm: Path) -> None:
    """values.schema.json must survive `helm package` (never .helmignore'd), or Helm stops enforcing it."""
    import subprocess
    import tarfile

    subprocess.run(
        [str(any_helm), "package", str(helm.CHART), "-d", str(tmp_path)], check=True, capture_output=True, timeout=60
    )
    (archive,) = tmp_path.glob("*.tgz")
    with tarfile.open(archive) as tar:
        assert "pd-inference/values.schema.json" in tar.getnames()
