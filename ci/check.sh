#!/usr/bin/env bash
# The checks users run in their CI (and `make lint` runs). Each step prints what it checked;
# the first failure stops the run with a message naming the file or field.
#
# Environment: PY, HELM (tools; HELM defaults to the Helm 4 of scripts/tools.env), KUBE_VERSION
# (helm lint's; default: the chart's minimum, Chart.yaml kubeVersion); BASE_REF (the branch a pull
# request targets, e.g. origin/main, for the version bump and upgrade safety checks); CHECK_SKIP
# (space-separated step ids to leave out, e.g. "checkov version-bump"; every skipped step is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/tools.env
PY=${PY:-.venv/bin/python}
HELM=${HELM:-$HELM4}
KUBE_VERSION=${KUBE_VERSION:-}
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
  "$PY" -m ci.chartdoc --check
fi

if step values-schema "values files and environment layerings against values.schema.json"; then
  "$PY" -m ci.values_check
fi

if step helm-lint "helm lint --strict, per environment"; then
  "$PY" -m ci.helm_lint --helm "$HELM" ${KUBE_VERSION:+--kube-version "$KUBE_VERSION"}
fi

rm -rf build/rendered
if step render "render each environment as its Argo CD Application does; Kubernetes schema validation"; then
  "$PY" -m ci.render --helm "$HELM" --out build/rendered
fi

if step checkov "checkov on the rendered manifests (skips: ci/checkov-skips.yaml)"; then
  [ -d build/rendered ] || "$PY" -m ci.render --helm "$HELM" --out build/rendered >/dev/null
  "$PY" -m ci.checkov_check --dir build/rendered
fi

if step version-bump "chart version bumped when templates or values changed"; then
  "$PY" -m ci.version_bump
fi

if step upgrade-safety "no immutable StatefulSet/Deployment field changed without a major version"; then
  "$PY" -m ci.upgrade_safety --helm "$HELM"
fi

if step ruff "ruff (lint and format) on Python code"; then
  "$PY" -m ruff check router ci tests charts/pd-inference/files
  "$PY" -m ruff format --check router ci tests charts/pd-inference/files
fi
