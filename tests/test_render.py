"""Every values file, scenario and environment layering renders with both Helm versions, passes
`helm lint --strict`, and every object validates against the schemas of every Kubernetes from the
chart's minimum (Chart.yaml kubeVersion) to the newest."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions

from ci import crd_schema, lib
from tests import cases, helm
from tests.cases import LAYERINGS, VALUES_FILES

KUBE_VERSIONS = [v for v in all_versions() if lib.supported(v)]


def test_kubernetes_versions_cover_the_supported_range() -> None:
    # kubernetes-validate has the schemas of the chart's minimum (Chart.yaml kubeVersion) itself.
    assert KUBE_VERSIONS[0].startswith("{}.{}.".format(*lib.KUBE_MIN_MINOR)), (lib.KUBE_MIN, KUBE_VERSIONS)
    assert len(KUBE_VERSIONS) >= 8, KUBE_VERSIONS


@pytest.mark.parametrize("name", LAYERINGS)
def test_renders_and_lints(any_helm: Path, name: str) -> None:
    files = LAYERINGS[name]
    result = helm.template(any_helm, files)
    assert result.returncode == 0, result.stderr
    kinds = {d["kind"] for d in result.docs}
    assert {"Deployment", "Service", "ConfigMap", "NetworkPolicy"} <= kinds
    assert kinds & {"StatefulSet", "LeaderWorkerSet"}  # one-node engines, or multi-node groups
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


def test_every_scenario_file_is_a_layering() -> None:
    """tests/scenarios/<name>.yaml is the layering `scenario:<name>`, its values files in order."""
    files = sorted(p.stem for p in cases.SCENARIOS.glob("*.yaml"))
    assert files == sorted(n.removeprefix("scenario:") for n in LAYERINGS if n.startswith("scenario:"))
    assert {"lmcache", "lmcache+staging", "qwen-g6+prod", "llama-p5+dev"} <= set(files)
    assert LAYERINGS["scenario:lmcache+staging"] == (
        cases.LMCACHE,
        "values/staging.yaml",
        "tests/values/lmcache-sidecar.yaml",
    )


@pytest.mark.parametrize(
    "text, error",
    [
        ("valueFiles: [values/dev.yaml]\nset: [a=b]\n", "nothing else"),
        ("valueFiles: []\n", "non-empty list"),
        ("- values/dev.yaml\n", "a scenario is `valueFiles:`"),
        ("valueFiles: [values/nope.yaml]\n", "values/nope.yaml"),
    ],
)
def test_a_malformed_scenario_file_is_refused_naming_it(tmp_path: Path, text: str, error: str) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ValueError, match="bad.yaml") as exc:
        cases.scenarios(tmp_path)
    assert error in str(exc.value)


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
