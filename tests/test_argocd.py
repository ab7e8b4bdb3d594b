"""Argo CD objects (argocd/): valid against the Argo CD 3.5.1 CRDs, one Application per environment
doing what the catalog says, each reproducing (helm template, as the repo server runs it) valid
Kubernetes, and an AppProject that permits exactly what the chart renders in the environments."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ci import crd_schema as crd_schemas
from ci import gitops, lib
from tests import helm
from tests.cluster import controlplane

ROOT = helm.ROOT
ENVS = lib.environments()
CONFIG = yaml.safe_load((ROOT / "argocd" / "config.yaml").read_text())["data"]

pytestmark = pytest.mark.xdist_group("argocd")


@functools.cache
def built() -> list[dict[str, Any]]:
    return gitops.kustomize_build()


def one_of(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in built() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@functools.cache
def apps() -> dict[str, dict[str, Any]]:
    return gitops.environment_applications()


@functools.cache
def argo_render(env: str) -> list[dict[str, Any]]:
    """What Argo CD applies for an environment: its Application's helm template command line."""
    args = gitops.helm_command(apps()[env], helm.helm_binaries()[0])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


# --- CRD schemas ------------------------------------------------------------------------------


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The Argo CD CRD's strict schema (ci/crds/, ci/crd_schema.py), with the metadata rules the
    API server applies to any object, and this project's: everything in the argocd namespace."""
    schema = copy.deepcopy(crd_schemas.schemas()[("argoproj.io/v1alpha1", kind)])
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name", "namespace"],
        "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
            "namespace": {"type": "string", "const": "argocd"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "finalizers": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    return schema


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema(doc["kind"]))
    return [
        f"{doc['kind']}/{doc['metadata'].get('name')}: /{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def all_argocd_objects() -> list[dict[str, Any]]:
    return built() + list(apps().values())


def test_every_argocd_object_validates_against_the_crds() -> None:
    objects = all_argocd_objects()
    assert {d["kind"] for d in objects} == {"AppProject", "ApplicationSet", "Application"}
    errors = [e for d in objects for e in _crd_errors(d)]
    assert not errors, "\n".join(errors)


def test_crd_validation_catches_a_misspelt_field() -> None:
    app = copy.deepcopy(apps()["dev"])
    app["spec"]["syncPolicy"]["automated"]["selfHeel"] = True
    app["spec"]["sources"][0]["helm"]["valueFiles"] = "not-a-list"
    errors = "\n".join(_crd_errors(app))
    assert "selfHeel" in errors and "/spec/sources/0/helm/valueFiles" in errors


# --- the one place: config.yaml ---------------------------------------------------------------


def test_repo_revision_and_cluster_come_from_config_only() -> None:
    text = "\n".join(yaml.safe_dump(d) for d in all_argocd_objects())
    for placeholder in ("REPO_URL", "TARGET_REVISION", "CLUSTER"):
        assert placeholder not in text, f"{placeholder} left unreplaced by kustomization.yaml"
    for path in (ROOT / "argocd").rglob("*.yaml"):
        if path.name == "config.yaml":
            continue
        assert CONFIG["repoURL"] not in path.read_text(), f"{path}: the repo URL belongs in argocd/config.yaml only"
    appset = one_of("ApplicationSet", "pd-inference")
    git = appset["spec"]["generators"][0]["git"]
    assert (git["repoURL"], git["revision"]) == (CONFIG["repoURL"], CONFIG["targetRevision"])
    boot = one_of("Application", "pd-inference-bootstrap")["spec"]["source"]
    assert (boot["repoURL"], boot["targetRevision"], boot["path"]) == (
        CONFIG["repoURL"],
        CONFIG["targetRevision"],
        "argocd",
    )
    for app in apps().values():
        assert app["spec"]["destination"]["server"] == CONFIG["cluster"]
        for src in app["spec"]["sources"]:
            assert (src["repoURL"], src["targetRevision"]) == (CONFIG["repoURL"], CONFIG["targetRevision"])
    assert all(
        p["sourceRepos"] == [CONFIG["repoURL"]] for p in (d["spec"] for d in built() if d["kind"] == "AppProject")
    )


def test_config_change_reaches_every_object(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "argocd", tmp_path / "argocd")
    cfg = tmp_path / "argocd" / "config.yaml"
    cfg.write_text(
        cfg.read_text()
        .replace(CONFIG["repoURL"], "https://git.example.com/fork.git")
        .replace(f"targetRevision: {CONFIG['targetRevision']}", "targetRevision: v1.2.3")
        .replace(CONFIG["cluster"], "https://gpu.example.com")
    )
    docs = gitops.kustomize_build(tmp_path / "argocd")
    text = yaml.safe_dump_all(docs)
    assert CONFIG["repoURL"] not in text
    assert text.count("https://git.example.com/fork.git") >= 5 and "v1.2.3" in text
    project = next(d for d in docs if d["metadata"]["name"] == "pd-inference" and d["kind"] == "AppProject")
    assert {d["server"] for d in project["spec"]["destinations"]} == {"https://gpu.example.com"}


def test_kustomize_reproduction_matches_kubectl_kustomize() -> None:
    """ci/gitops.py's kustomize subset against the real kustomize in kubectl (built by `make kube`)."""
    kubectl = Path(controlplane.manifest()["kubernetes"][controlplane.versions()[0]]) / "kubectl"
    proc = subprocess.run([kubectl, "kustomize", str(ROOT / "argocd")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    real = sorted((d for d in yaml.safe_load_all(proc.stdout) if d), key=lambda d: (d["kind"], d["metadata"]["name"]))
    ours = sorted(built(), key=lambda d: (d["kind"], d["metadata"]["name"]))
    assert ours == real


# --- generated Applications -------------------------------------------------------------------


def test_one_application_per_environment() -> None:
    assert set(apps()) == set(ENVS) == {"dev", "staging", "prod"}
    assert {a["metadata"]["name"] for a in apps().values()} == {f"pd-{e}" for e in ENVS}


@pytest.mark.parametrize("env", sorted(ENVS))
def test_application_follows_the_catalog(env: str) -> None:
    app, cat = apps()[env], ENVS[env]
    spec = app["spec"]
    assert spec["project"] == "pd-inference"
    assert spec["destination"] == {"server": CONFIG["cluster"], "namespace": cat["namespace"]}
    chart, values = spec["sources"]
    assert chart["path"] == "charts/pd-inference" and "ref" not in chart
    assert values == {"repoURL": CONFIG["repoURL"], "targetRevision": CONFIG["targetRevision"], "ref": "values"}
    assert chart["helm"]["releaseName"] == "pd"
    assert chart["helm"]["valueFiles"] == [f"$values/{f}" for f in cat["valueFiles"]]
    assert chart["helm"]["skipTests"] is True
    sync = spec["syncPolicy"]
    assert {"CreateNamespace=true", "RespectIgnoreDifferences=true"} <= set(sync["syncOptions"])
    assert sync["retry"]["limit"] >= 3 and sync["retry"]["backoff"]["factor"] >= 2
    if cat["autoSync"]:
        assert sync["automated"] == {"prune": True, "selfHeal": True}
    else:
        assert "automated" not in sync, f"{env} must sync by hand"


def test_prod_syncs_by_hand_dev_and_staging_automatically() -> None:
    assert ENVS["prod"]["autoSync"] is False
    assert ENVS["dev"]["autoSync"] is True and ENVS["staging"]["autoSync"] is True


@pytest.mark.parametrize("env", sorted(ENVS))
def test_ignore_differences_cover_exactly_the_autoscaled_workloads(env: str) -> None:
    docs = argo_render(env)
    owned = sorted(
        (d["spec"]["scaleTargetRef"]["kind"], d["spec"]["scaleTargetRef"]["name"])
        for d in docs
        if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
    )
    catalog = sorted((a["kind"], a["name"]) for a in ENVS[env]["autoscaled"])
    assert catalog == owned, f"argocd/environments/{env}.yaml autoscaled must list {owned}"
    ignored = sorted(
        (i["kind"], i["name"])
        for i in apps()[env]["spec"].get("ignoreDifferences", [])
        if "/spec/replicas" in i["jsonPointers"]
    )
    assert ignored == owned
    workloads = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for key in owned:
        assert "replicas" not in workloads[key]["spec"], f"{key}: the chart must leave replicas to the autoscaler"


def test_bootstrap_application_syncs_argocd_itself() -> None:
    boot = one_of("Application", "pd-inference-bootstrap")
    assert boot["spec"]["project"] == "pd-inference-bootstrap"
    assert boot["spec"]["source"]["path"] == "argocd"
    assert boot["spec"]["syncPolicy"]["automated"] == {"prune": True, "selfHeal": True}
    bproj = one_of("AppProject", "pd-inference-bootstrap")["spec"]
    assert {(w["group"], w["kind"]) for w in bproj["namespaceResourceWhitelist"]} == {
        ("argoproj.io", k) for k in ("AppProject", "ApplicationSet", "Application")
    }
    assert bproj["clusterResourceWhitelist"] == []
    assert bproj["destinations"] == [{"server": "https://kubernetes.default.svc", "namespace": "argocd"}]
    # Everything in argocd/ is applied by the bootstrap Application: all of it must be permitted.
    kinds = {(d["apiVersion"].split("/")[0], d["kind"]) for d in built()}
    assert kinds == {("argoproj.io", k) for k in ("AppProject", "ApplicationSet", "Application")}


def test_applicationset_uses_strict_go_templates() -> None:
    spec = one_of("ApplicationSet", "pd-inference")["spec"]
    assert spec["goTemplate"] is True and spec["goTemplateOptions"] == ["missingkey=error"]
    assert spec["generators"][0]["git"]["files"] == [{"path": "argocd/environments/*.yaml"}]


def test_catalog_file_missing_a_key_fails_generation(tmp_path: Path) -> None:
    for sub in ("argocd", "values"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    dev = tmp_path / "argocd" / "environments" / "dev.yaml"
    dev.write_text(dev.read_text().replace("autoSync: true", ""))
    with pytest.raises(gitops.GitOpsError, match="autoSync"):
        gitops.environment_applications(tmp_path)


def test_catalog_file_named_otherwise_than_its_file_is_refused(tmp_path: Path) -> None:
    """The one catalog loader (ci/lib.py environments()) that gitops, CI and the tests share."""
    for sub in ("argocd", "values"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    dev = tmp_path / "argocd" / "environments" / "dev.yaml"
    dev.write_text(dev.read_text().replace("name: dev\n", "name: develop\n"))
    with pytest.raises(lib.CatalogError, match=r"argocd/environments/dev.yaml: name must be 'dev'"):
        gitops.environment_applications(tmp_path)


# --- what Argo CD renders ---------------------------------------------------------------------


@pytest.mark.parametrize("env", sorted(ENVS))
def test_argocd_render_is_valid_kubernetes(env: str) -> None:
    docs = argo_render(env)
    errors = []
    for doc in docs:
        assert doc["metadata"].get("namespace") == ENVS[env]["namespace"], f"{doc['kind']} outside the destination"
        if crd_schemas.is_custom_resource(doc):
            errors += crd_schemas.validate(doc)
            continue
        try:
            kubernetes_validate.validate(doc, helm.KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("env", sorted(ENVS))
def test_argocd_render_equals_make_render_without_the_test_hook(env: str) -> None:
    """The Application renders what the chart tests render, minus the helm test Pod."""
    plain = helm.render(helm.helm_binaries()[0], tuple(ENVS[env]["valueFiles"]), namespace=ENVS[env]["namespace"])
    hooks = [d for d in plain if "helm.sh/hook" in d["metadata"].get("annotations", {})]
    assert [(d["kind"], d["metadata"]["annotations"]["helm.sh/hook"]) for d in hooks] == [("Pod", "test")]
    assert argo_render(env) == [d for d in plain if d not in hooks]


def make_render(env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "render", f"ENV={env}"], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_make_render_prints_what_argo_cd_applies() -> None:
    """`make render ENV=prod` is what a user reviews: the Application's render, monitors included."""
    proc = make_render("prod")
    assert proc.returncode == 0, proc.stderr
    assert [d for d in yaml.safe_load_all(proc.stdout) if d] == argo_render("prod")


def test_make_render_of_an_unknown_environment_lists_the_catalog() -> None:
    proc = make_render("qa")
    assert proc.returncode != 0 and not proc.stdout
    assert "no environment 'qa' in the catalog (argocd/environments/): have dev, prod, staging" in proc.stderr


def test_make_render_of_a_values_file_outside_the_catalog_is_an_error_naming_the_catalog() -> None:
    """A values file that is no environment (here a profile) is not rendered standalone."""
    assert (ROOT / "values/profiles/qwen3.5-9b-g6.yaml").is_file()
    proc = make_render("profiles/qwen3.5-9b-g6")
    assert proc.returncode != 0 and not proc.stdout
    assert "values/profiles/qwen3.5-9b-g6.yaml is not an environment" in proc.stderr
    assert "the catalog (argocd/environments/) has dev, prod, staging" in proc.stderr


# --- the AppProject permits exactly what the chart needs --------------------------------------


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def test_project_permits_exactly_what_the_environments_render() -> None:
    project = one_of("AppProject", "pd-inference")["spec"]
    needed = {(_group(d["apiVersion"]), d["kind"]) for env in ENVS for d in argo_render(env)}
    allowed = {(w["group"], w["kind"]) for w in project["namespaceResourceWhitelist"]}
    missing, unused = needed - allowed, allowed - needed
    assert not missing, f"argocd/project.yaml namespaceResourceWhitelist must add {sorted(missing)} (sync would fail)"
    assert not unused, f"argocd/project.yaml permits {sorted(unused)}, which no environment renders: remove"
    # CreateNamespace=true: the environments' namespaces, by name, and no other cluster-scoped kind.
    assert sorted((w["group"], w["kind"], w.get("name")) for w in project["clusterResourceWhitelist"]) == sorted(
        ("", "Namespace", e["namespace"]) for e in ENVS.values()
    )


def test_project_destinations_and_sources_are_exact() -> None:
    project = one_of("AppProject", "pd-inference")["spec"]
    assert sorted(d["namespace"] for d in project["destinations"]) == sorted(e["namespace"] for e in ENVS.values())
    assert project["sourceRepos"] == [CONFIG["repoURL"]]
    flat = yaml.safe_dump([d["spec"] for d in built() if d["kind"] == "AppProject"])
    assert "'*'" not in flat and '"*"' not in flat, "no wildcards in the AppProjects"


def test_chart_features_off_in_every_environment_need_a_project_change() -> None:
    """Turning on an HPA (not used by any environment) renders a kind the project does not permit;
    the whitelist test above then names it. Documented in argocd/project.yaml."""
    docs = helm.render(
        helm.helm_binaries()[0],
        ("values/profiles/llama-3.3-70b-p5.yaml", "values/prod.yaml"),
        sets=(
            "prefill.autoscaling.enabled=true",
            "prefill.autoscaling.metrics[0].type=Pods",
            "prefill.autoscaling.metrics[0].pods.metric.name=vllm_queue",
            "prefill.autoscaling.metrics[0].pods.target.type=AverageValue",
            "prefill.autoscaling.metrics[0].pods.target.averageValue=4",
        ),
    )
    allowed = {
        (w["group"], w["kind"]) for w in one_of("AppProject", "pd-inference")["spec"]["namespaceResourceWhitelist"]
    }
    assert ("autoscaling", "HorizontalPodAutoscaler") in {(_group(d["apiVersion"]), d["kind"]) for d in docs}
    assert ("autoscaling", "HorizontalPodAutoscaler") not in allowed


# --- the Go template subset ---------------------------------------------------------------------


def test_go_template_subset() -> None:
    t = gitops.go_template
    assert t("a-{{ .x.y }}-b", {"x": {"y": "v"}}) == "a-v-b"
    assert t("l:\n{{- range .l }}\n  - {{ . | quote }}\n{{- end }}\n", {"l": ["p", "q"]}) == 'l:\n  - "p"\n  - "q"\n'
    assert t("{{ if .b }}yes{{ else }}no{{ end }}", {"b": False}) == "no"
    assert t('{{ printf "$values/%s" .f }}', {"f": "x.yaml"}) == "$values/x.yaml"
    with pytest.raises(gitops.GitOpsError, match="missingkey"):
        t("{{ .nope }}", {})
    with pytest.raises(gitops.GitOpsError, match="unsupported"):
        t("{{ .x | upper }}", {"x": "a"})
