#!/usr/bin/env bash
# The checks users run in their CI (and `make lint` runs). Each step prints what it checked;
# the first failure stops the run with a message naming the file or field.
#
# Environment: PY, HELM, KUBE_VERSION (tools); BASE_REF (the branch a pull request targets, e.g.
# origin/main, for the version bump and upgrade safety checks); CHECK_SKIP (space-separated step
# ids to leave out, e.g. "checkov version-bump"; every skipped step is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
HELM=${HELM:-.tools/helm-v4.2.1/helm}
CHART=charts/pd-inference
KUBE_VERSION=${KUBE_VERSION:-1.29.0}
CHECK_SKIP=${CHECK_SKIP:-}

step() { # id, title: prints the title; returns 1 (skip the step) when the id is in CHECK_SKIP
  if [[ " $CHECK_SKIP " == *" $1 "* ]]; then printf '\n== %s: SKIPPED (CHECK_SKIP)\n' "$2"; return 1; fi
  printf '\n== %s\n' "$2"
}

if step yamllint "yamllint (every YAML file; chart templates excluded: they are Go templates)"; then
  "$PY" -m yamllint .
  echo "ok: yamllint"
fi

if step chartdoc "values.schema.json and chart README are generated from values.yaml"; then
  "$PY" ci/chartdoc.py --check
fi

if step values-schema "values files and environment layerings against values.schema.json"; then
  "$PY" ci/values_check.py
fi

if step helm-lint "helm lint --strict, per environment"; then
  for env in $("$PY" ci/envs.py list); do
    files=()
    for f in $("$PY" ci/envs.py files "$env"); do files+=(-f "$f"); done
    # helm lint takes no --api-versions: the custom resources render by crds.assumeInstalled.
    "$HELM" lint --strict "$CHART" --kube-version "$KUBE_VERSION" --set crds.assumeInstalled=true "${files[@]}" >/dev/null
    echo "ok: $env"
  done
fi

rm -rf build/rendered
if step render "render each environment as its Argo CD Application does; Kubernetes schema validation"; then
  "$PY" ci/render.py --helm "$HELM" --out build/rendered
fi

if step checkov "checkov on the rendered manifests (skips: ci/checkov-skips.yaml)"; then
  [ -d build/rendered ] || "$PY" ci/render.py --helm "$HELM" --out build/rendered >/dev/null
  "$PY" ci/checkov_check.py --dir build/rendered
fi

if step version-bump "chart version bumped when templates or values changed"; then
  "$PY" ci/version_bump.py
fi

if step upgrade-safety "no immutable StatefulSet/Deployment field changed without a major version"; then
  "$PY" ci/upgrade_safety.py
fi

if step ruff "ruff (lint and format) on Python code"; then
  "$PY" -m ruff check router ci tests charts/pd-inference/files
  "$PY" -m ruff format --check router ci tests charts/pd-inference/files
fi
