"""ci/check.sh, the entry point users run in their CI (`make lint`), and each of its checks:
the whole script passes on this checkout, and each check fails on bad input with a message that
names the file or field."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ci import checkov_check, crd_schema, lib, version_bump
from tests import helm

ROOT = helm.ROOT
PY = sys.executable

pytestmark = pytest.mark.xdist_group("ci")


def run(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )


@functools.cache
def check_sh() -> subprocess.CompletedProcess[str]:
    # checkov has its own test below (it names the findings). The version bump also runs here: on
    # a fresh clone of main it says it skipped and why; on a branch it checks against origin/main.
    return run("bash", "ci/check.sh", env={"PY": PY, "CHECK_SKIP": "checkov"})


def test_check_sh_passes() -> None:
    result = check_sh()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for title in ("yamllint", "values.schema.json", "helm lint", "render each environment", "immutable", "ruff"):
        assert title in result.stdout, f"check.sh no longer runs the {title!r} step"
    assert "checkov on the rendered manifests (skips: ci/checkov-skips.yaml): SKIPPED (CHECK_SKIP)" in result.stdout
    assert result.stdout.count("SKIPPED (CHECK_SKIP)") == 1


def test_check_sh_is_what_make_lint_runs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "\nlint:" in makefile and "ci/check.sh" in makefile.split("\nlint:")[1].split("\n\n")[0]


# --- ci/lib.py: one home per fact ---------------------------------------------------------------


def test_helm_pins_live_in_tools_env_and_bash_make_and_python_read_them_alike() -> None:
    pins = lib.tools()
    expected = [ROOT / ".tools" / f"helm-{pins[f'HELM{m}_VERSION']}" / "helm" for m in (4, 3)]
    assert expected == [lib.HELM4, lib.HELM3]
    assert lib.helm_binaries() == [lib.HELM4, lib.HELM3]
    shell = run("bash", "-c", ". scripts/tools.env && echo $HELM4 $HELM3 $PROMETHEUS_DIR")
    make = run("make", "-s", "--eval", "pins: ; @echo $(HELM4) $(HELM3) $(PROMETHEUS_DIR)", "pins")
    want = f"{pins['HELM4']} {pins['HELM3']} {pins['PROMETHEUS_DIR']}\n"
    assert (shell.stdout, make.stdout) == (want, want), (shell.stderr, make.stderr)
    # Nowhere else: no pinned version or .tools/helm-* path in the code that runs Helm.
    pinned = re.compile("|".join(re.escape(pins[k]) for k in ("HELM4_VERSION", "HELM3_VERSION", "PROMETHEUS_VERSION")))
    code = [ROOT / "Makefile", ROOT / "ci" / "check.sh", *ROOT.glob("scripts/*.sh"), *ROOT.glob("ci/*.py")]
    code += [p for p in ROOT.glob("tests/**/*.py") if p != Path(__file__)]
    for path in code:
        text = path.read_text()
        assert not pinned.search(text) and ".tools/helm-v" not in text, (
            f"{path.relative_to(ROOT)}: read scripts/tools.env"
        )


def test_the_minimum_kubernetes_is_chart_yaml_kube_version() -> None:
    kube_version = yaml.safe_load((helm.CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert kube_version == f">={lib.KUBE_MIN}-0"
    assert helm.KUBE_VERSION == lib.KUBE_MIN
    major, minor = lib.KUBE_MIN_MINOR
    assert lib.supported(lib.KUBE_MIN) and not lib.supported(f"{major}.{minor - 1}")


def test_one_helm_template_builder() -> None:
    args = lib.helm_template(
        ["values/dev.yaml"], ["a=1"], ["b=2"], helm="helm", namespace="ns", include_crds=True, skip_tests=True
    )
    assert args[:6] == ["helm", "template", "pd", str(helm.CHART), "--namespace", "ns"]
    assert args[args.index("-f") + 1] == str(ROOT / "values/dev.yaml")
    assert args.index("--set") < args.index("--set-string")
    assert {"--include-crds", "--skip-tests"} <= set(args) and "--skip-crds" not in args
    assert args[args.index("--kube-version") + 1] == lib.KUBE_MIN
    assert [args[i + 1] for i, a in enumerate(args) if a == "--api-versions"] == crd_schema.api_versions()
    assert "--api-versions" not in lib.helm_template(namespace="ns", api_versions=False)
    lint = lib.helm_lint(["values/dev.yaml"], helm="helm")
    assert lint[:3] == ["helm", "lint", "--strict"] and lint[lint.index("--kube-version") + 1] == lib.KUBE_MIN


def test_an_unknown_environment_is_an_error_listing_the_catalog() -> None:
    assert list(lib.environments()) == ["dev", "prod", "staging"]
    with pytest.raises(
        lib.CatalogError, match=r"no environment 'qa' in the catalog \(argocd/environments/\): have dev, prod, staging"
    ):
        lib.environment("qa")
    with pytest.raises(lib.CatalogError, match=r"values/profiles/qwen3.5-9b-g6.yaml is not an environment"):
        lib.environment("profiles/qwen3.5-9b-g6")


def test_ci_modules_run_as_python_m_without_editing_sys_path() -> None:
    for path in ROOT.glob("ci/*.py"):
        assert "sys.path.insert" not in path.read_text(), (
            f"{path.relative_to(ROOT)}: run it as python -m ci.{path.stem}"
        )
    for path in (ROOT / "Makefile", ROOT / "ci" / "check.sh"):
        assert not re.search(r"\bci/\w+\.py\b", path.read_text()), f"{path.name}: call python -m ci.<name>"
    result = run(PY, "-m", "ci.helm_lint", "--help")
    assert result.returncode == 0 and "--kube-version" in result.stdout, result.stderr


# --- values schema step -------------------------------------------------------------------------


def test_broken_values_file_fails_the_schema_step_naming_the_field(tmp_path: Path) -> None:
    for sub in ("charts/pd-inference", "values", "argocd/environments"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    prod = tmp_path / "values" / "prod.yaml"
    data = yaml.safe_load(prod.read_text())
    data["decode"]["autoscaling"]["maxReplicas"] = "eight"
    data["router"]["replicsa"] = 2
    prod.write_text(yaml.safe_dump(data))
    result = run(PY, "-m", "ci.values_check", "--root", str(tmp_path))
    assert result.returncode == 1
    assert "values/prod.yaml: /decode/autoscaling/maxReplicas: 'eight' is not of type 'integer'" in result.stderr
    assert "values/prod.yaml: /router/replicsa:" in result.stderr
    # The layering that includes it fails too, and names the environment.
    assert "environment prod (" in result.stderr
    assert "ok: values/dev.yaml" in result.stdout


def test_schema_step_checks_a_layering_given_on_the_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kvTransfer:\n  connector: mooncake\n")
    result = run(PY, "-m", "ci.values_check", "values/dev.yaml", str(bad))
    assert result.returncode == 1 and "/kvTransfer/connector: 'mooncake' is not one of" in result.stderr


# --- checkov step -------------------------------------------------------------------------------


@functools.cache
def checkov_run() -> subprocess.CompletedProcess[str]:
    # A directory of this process's own: pytest-xdist workers must not render into one folder.
    out = Path(tempfile.mkdtemp(prefix="pd-checkov-"))
    rendered = run(PY, "-m", "ci.render", "--out", str(out))
    assert rendered.returncode == 0, rendered.stderr
    return run(PY, "-m", "ci.checkov_check", "--dir", str(out))


@pytest.mark.xdist_group("checkov")  # one checkov run serves both tests
def test_checkov_passes_with_the_documented_skips() -> None:
    result = checkov_run()
    assert result.returncode == 0, result.stderr


@pytest.mark.xdist_group("checkov")
def test_checkov_reports_what_it_skipped_and_why() -> None:
    result = checkov_run()
    assert "checkov failed" not in result.stderr and "not installed" not in result.stderr, result.stderr
    skips = checkov_check.load_skips()
    for s in skips:
        assert f"skipped: {s['id']} on " in result.stdout
        assert len(s["reason"].split()) >= 10, f"{s['id']}: give a real reason"
    assert "STALE SKIP" not in result.stderr


def test_checkov_triage() -> None:
    F = checkov_check.Finding
    findings = [
        F("CKV_K8S_25", "caps", "StatefulSet.pd-prod.pd-pd-inference-decode", "prod.yaml"),
        F("CKV_K8S_25", "caps", "Deployment.pd-prod.pd-pd-inference-router", "prod.yaml"),
        F("CKV_K8S_11", "cpu", "Deployment.pd-dev.pd-pd-inference-router", "dev.yaml"),
    ]
    skips = [
        {"id": "CKV_K8S_25", "reason": "r", "resources": ["StatefulSet.*.pd-pd-inference-decode"]},
        {"id": "CKV_K8S_11", "reason": "r"},
        {"id": "CKV_K8S_99", "reason": "r"},
    ]
    failed, skipped, stale = checkov_check.triage(findings, skips)
    assert failed == [findings[1]]  # the router is not covered by the resource-scoped skip
    assert skipped == [findings[0], findings[2]]
    assert stale == ["CKV_K8S_99"]
    skips[0]["resources"].append("StatefulSet.*.gone")
    assert "CKV_K8S_25 resource 'StatefulSet.*.gone'" in checkov_check.triage(findings, skips)[2]


def test_checkov_skips_file_lists_every_skip_with_a_reason() -> None:
    text = (ROOT / "ci" / "checkov-skips.yaml").read_text()
    assert "--skip-check" not in (ROOT / "ci" / "check.sh").read_text()
    assert all(s["reason"].strip() for s in yaml.safe_load(text)["skips"])


# --- chart version bump step --------------------------------------------------------------------


def _git(repo: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def chart_repo(tmp_path: Path) -> Path:
    chart = tmp_path / "charts" / "pd-inference"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: pd-inference\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("a: 1\n")
    (chart / "templates" / "cm.yaml").write_text("kind: ConfigMap\n")
    (tmp_path / "README.md").write_text("x\n")
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def _bump(repo: Path, version: str) -> None:
    p = repo / "charts" / "pd-inference" / "Chart.yaml"
    p.write_text(p.read_text().replace("version: 0.1.0", f"version: {version}"))


def test_version_bump_single_commit_skips_and_says_why(chart_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert version_bump.main(chart_repo, env={}) == 0
    assert "skipped: no base" in capsys.readouterr().out


@pytest.mark.parametrize("path", ["charts/pd-inference/templates/cm.yaml", "charts/pd-inference/values.yaml"])
def test_version_bump_required_when_chart_changes(
    chart_repo: Path, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _git(chart_repo, "tag", "v0.1.0")  # released: main is now checked against it
    _git(chart_repo, "commit", "-q", "--allow-empty", "-m", "two")
    (chart_repo / path).write_text("changed: true\n")
    assert version_bump.main(chart_repo, env={}) == 1
    err = capsys.readouterr().err
    assert "version is still 0.1.0" in err and path in err
    _bump(chart_repo, "0.1.1")
    assert version_bump.main(chart_repo, env={}) == 0
    _bump(chart_repo, "0.0.9")
    (chart_repo / "charts/pd-inference/Chart.yaml").write_text("apiVersion: v2\nname: pd-inference\nversion: 0.0.9\n")
    assert version_bump.main(chart_repo, env={}) == 1
    assert "went down" in capsys.readouterr().err


def test_version_bump_against_base_ref_and_new_files(chart_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _git(chart_repo, "tag", "v0.1.0")
    (chart_repo / "README.md").write_text("docs only\n")
    _git(chart_repo, "commit", "-qam", "docs")
    assert version_bump.main(chart_repo, env={}) == 0  # v0.1.0..HEAD: README only
    (chart_repo / "charts/pd-inference/templates/new.yaml").write_text("kind: Service\n")  # untracked
    assert version_bump.main(chart_repo, env={"BASE_REF": "HEAD"}) == 1
    assert "new.yaml" in capsys.readouterr().err
    assert version_bump.main(chart_repo, env={"BASE_REF": "no-such-ref"}) == 1
    assert "not a commit here" in capsys.readouterr().err


def test_a_missing_python_is_named_with_the_way_out(tmp_path) -> None:
    """`make demo` with no such interpreter: one line naming it and PYTHON=, not make's Error 127."""
    out = subprocess.run(
        ["make", "-s", "demo", f"VENV={tmp_path / 'venv'}", "PYTHON=python3.99-absent"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "python3.99-absent not found" in out.stderr and "PYTHON=/path/to/python3.11" in out.stderr
    assert "Error 127" not in out.stderr
