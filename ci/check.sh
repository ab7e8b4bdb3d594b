#!/usr/bin/env bash
# The checks users run in their CI (and `make lint` runs). Each step prints what it checked;
# the first failure stops the run with a message naming the file or field.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
HELM=${HELM:-.tools/helm-v4.2.1/helm}
CHART=charts/pd-inference
KUBE_VERSION=${KUBE_VERSION:-1.29.0}

step() { printf '\n== %s\n' "$*"; }

step "values.schema.json and chart README are generated from values.yaml"
"$PY" ci/chartdoc.py --check

step "helm lint --strict, per environment"
for env in $("$PY" ci/envs.py list); do
  files=()
  for f in $("$PY" ci/envs.py files "$env"); do files+=(-f "$f"); done
  "$HELM" lint --strict "$CHART" --kube-version "$KUBE_VERSION" "${files[@]}" >/dev/null
  echo "ok: $env"
done

step "ruff (lint and format) on Python code"
"$PY" -m ruff check router ci tests
"$PY" -m ruff format --check router ci tests
