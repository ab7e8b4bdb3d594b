"""Render every environment exactly as its Argo CD Application does and validate each object
against the Kubernetes OpenAPI schemas (oldest supported and newest known version, strict), and
each custom resource against its CRD in ci/crds/ (strict, ci/crd_schema.py).
Writes build/rendered/<env>.yaml for the next steps (checkov).

    python -m ci.render [--helm PATH] [--out DIR]
    python -m ci.render --print ENV [--helm PATH]   # ENV's manifests on stdout (make render)
    python -m ci.render --print ENV --values F...  # ... with F layered last (make render VALUES=...)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml
from kubernetes_validate.utils import all_versions

from ci import crd_schema, gitops, lib

ROOT = lib.ROOT


def kube_versions() -> list[str]:
    """The oldest supported (lib.KUBE_MIN) and the newest Kubernetes kubernetes-validate knows."""
    versions = [v for v in all_versions() if lib.supported(v)]
    return [versions[0], versions[-1]]


def render(helm: str | Path, app: dict) -> str:
    proc = subprocess.run(gitops.helm_command(app, helm), capture_output=True, text=True, timeout=120, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{app['metadata']['name']}: helm template failed:\n{proc.stderr}")
    return proc.stdout


def validate(docs: list[dict]) -> list[str]:
    errors = []
    for doc in docs:
        if crd_schema.is_custom_resource(doc):
            errors += [f"CRD {e}" for e in crd_schema.validate(doc)]
            continue
        for version in kube_versions():
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(map(str, exc.path))
                errors.append(f"Kubernetes {version} {doc['kind']}/{doc['metadata']['name']}: /{path}: {exc.message}")
    return errors


def print_env(helm: str, env: str | None, values: list[str]) -> int:
    """`make render ENV=... [VALUES="a.yaml b.yaml"]`: the manifests only, on stdout, with
    `values` layered after ENV's value files (as adding them to its valueFiles would); an unknown
    ENV lists the catalog. Without ENV: `values` over the chart defaults, release `pd` in namespace
    `default` (an example that is no environment of the catalog, e.g. docs/examples/two-models/)."""
    missing = [v for v in values if not (ROOT / v).is_file()]
    if missing:
        print(f"render: VALUES {missing} do not exist (paths are from the repository root)", file=sys.stderr)
        return 2
    if env or not values:  # neither: the catalog error lists the environments
        try:
            app = gitops.environment_application(env or "")
        except lib.CatalogError as exc:
            print(f"render: {exc}", file=sys.stderr)
            return 2
        command = gitops.helm_command(app, helm) + lib.value_flags(values)
    else:
        command = lib.helm_template(values, helm=helm, namespace="default", include_crds=True)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"render: helm template failed:\n{proc.stderr}")
    sys.stdout.write(proc.stdout)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--helm", default=str(lib.HELM))
    parser.add_argument("--out", default=str(ROOT / "build" / "rendered"))
    parser.add_argument("--print", metavar="ENV", dest="env", help="print ENV's manifests instead (no checks)")
    parser.add_argument("--values", nargs="*", default=[], help="with --print: value files layered after ENV's")
    args = parser.parse_args(argv)
    if args.env is not None or args.values:
        return print_env(args.helm, args.env, args.values)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = False
    for env, app in gitops.environment_applications().items():
        text = render(args.helm, app)
        docs = [d for d in yaml.safe_load_all(text) if d]
        (out / f"{env}.yaml").write_text(text)
        errors = validate(docs)
        for e in errors:
            print(f"{env}: {e}", file=sys.stderr)
        failed |= bool(errors)
        if not errors:
            kinds = sorted({d["kind"] for d in docs if not crd_schema.is_custom_resource(d)})
            custom = sorted({d["kind"] for d in docs if crd_schema.is_custom_resource(d)})
            line = f"ok: {env}: {len(docs)} objects ({', '.join(kinds)}) valid for Kubernetes {' and '.join(kube_versions())}"
            if custom:
                line += f"; {', '.join(custom)} valid for their CRDs (ci/crds/)"
            print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
