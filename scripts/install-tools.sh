#!/usr/bin/env bash
# Installs, idempotently: Helm 4 and Helm 3 (from their Go modules when no matching helm is on
# PATH) into .tools/, checkov into .tools/checkov-venv, Prometheus (server and promtool, from its Go
# module) into .tools/prometheus-<PROMETHEUS_VERSION>/{prometheus,promtool}, and llm-d-inference-sim
# when its installer exists. `make tools` also runs scripts/install-engine-stack.sh and
# scripts/install-kube.sh. Versions are pinned here and nowhere else.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 1>&2  # progress goes to stderr: `make render` prints only manifests on stdout

# Helm 4.2.1 is the version Argo CD 3.5 embeds; 3.21.4 is the newest Helm 3.21.x (checked 2026-11-29).
HELM4_VERSION=v4.2.1
HELM3_VERSION=v3.21.4
# Prometheus v0.316.0 is Prometheus 3.16.0 (3.x is tagged v0.3MINOR.PATCH for Go modules), the newest
# the Go module proxy serves (checked 2026-12-01).
PROMETHEUS_VERSION=v0.316.0
TOOLS="$PWD/.tools"

install_helm() { # major version, e.g. "4" "v4.2.1"
  local major=$1 version=$2 dir="$TOOLS/helm-$2"
  # A Helm built by `go install` reports only "vMAJOR.MINOR", so the stamp records the full version.
  if [ -x "$dir/helm" ] && [ "$(cat "$dir/.version" 2>/dev/null)" = "$version" ]; then
    return 0
  fi
  mkdir -p "$dir"
  local onpath
  onpath=$(command -v helm || true)
  if [ -n "$onpath" ] && "$onpath" version --template "{{.Version}}" 2>/dev/null | grep -qx "$version"; then
    ln -sf "$onpath" "$dir/helm"
    echo "$version" > "$dir/.version"
    return 0
  fi
  command -v go >/dev/null || { echo "install-tools: Go is needed to build Helm $version (none on PATH)" >&2; exit 1; }
  echo "install-tools: building Helm $version from helm.sh/helm/v$major (first run only, a few minutes)"
  GOBIN="$dir" GOFLAGS=-mod=mod go install "helm.sh/helm/v$major/cmd/helm@$version"
  echo "$version" > "$dir/.version"
}

install_prometheus() { # both binaries from one `go install`; the web UI assets are not embedded (the API works)
  local version=$PROMETHEUS_VERSION dir="$TOOLS/prometheus-$PROMETHEUS_VERSION" module=github.com/prometheus/prometheus
  if [ -x "$dir/prometheus" ] && [ -x "$dir/promtool" ] && [ "$(cat "$dir/.version" 2>/dev/null)" = "$version" ]; then
    return 0
  fi
  command -v go >/dev/null || { echo "install-tools: Go is needed to build Prometheus $version (none on PATH)" >&2; exit 1; }
  echo "install-tools: building Prometheus $version (prometheus, promtool) from $module (first run only, a few minutes)"
  mkdir -p "$dir"
  # Without the version ldflags both binaries report an empty version. The release number is the
  # module's VERSION file; the proxy records no commit, so the tag stands in for the revision.
  local download src info release date
  download=$(GOFLAGS=-mod=mod go mod download -json "$module@$version")
  src=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$download")
  info=$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",$/\1/p' <<<"$download")
  release=$(cat "$src/VERSION")
  date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info")  # the tag's date: {"Version":...,"Time":...}
  local v=github.com/prometheus/common/version
  local ldflags="-s -w -X $v.Version=$release -X $v.Revision=$version -X $v.Branch=HEAD"
  ldflags+=" -X $v.BuildUser=install-tools -X $v.BuildDate=$date"
  GOBIN="$dir" GOFLAGS=-mod=mod go install -ldflags "$ldflags" "$module/cmd/prometheus@$version" "$module/cmd/promtool@$version"
  echo "$version" > "$dir/.version"
}

# What to install: `helm` (both versions), `checkov`, `prometheus`, `llm-d-sim`; no argument = all four.
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(helm checkov prometheus llm-d-sim)
for part in "${parts[@]}"; do
  case "$part" in
    helm)
      install_helm 4 "$HELM4_VERSION"
      install_helm 3 "$HELM3_VERSION"
      for version in "$HELM4_VERSION" "$HELM3_VERSION"; do
        echo "install-tools: helm $version ($("$TOOLS/helm-$version/helm" version --template '{{.GoVersion}}')) at .tools/helm-$version/helm"
      done
      ;;
    checkov)
      # checkov (the CI security scan) lives in its own virtualenv: see scripts/install-checkov.sh.
      scripts/install-checkov.sh
      echo "install-tools: $(.tools/checkov-venv/bin/checkov --version | sed 's/^/checkov /') at .tools/checkov-venv"
      ;;
    prometheus)
      install_prometheus
      echo "install-tools: $("$TOOLS/prometheus-$PROMETHEUS_VERSION/prometheus" --version | head -1) at .tools/prometheus-$PROMETHEUS_VERSION/{prometheus,promtool}"
      ;;
    llm-d-sim)
      if [ -x router/tools/install-llm-d-sim.sh ]; then
        router/tools/install-llm-d-sim.sh || echo "install-tools: llm-d-inference-sim not installed (its interop test will skip and say why)"
      fi
      ;;
    *) echo "install-tools: unknown part $part (helm, checkov, prometheus, llm-d-sim)"; exit 2 ;;
  esac
done
