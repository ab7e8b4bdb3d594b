#!/usr/bin/env bash
# Installs, idempotently: Helm 4 and Helm 3 (from their Go modules when no matching helm is on
# PATH) into .tools/, checkov into .tools/checkov-venv, Prometheus (server and promtool, from its Go
# module) into .tools/prometheus-<PROMETHEUS_VERSION>/{prometheus,promtool}, the OpenTelemetry
# Collector (built by its builder from Go modules) into .tools/otelcol-<OTELCOL_VERSION>/otelcol-pd,
# and llm-d-inference-sim when its installer exists. `make tools` also runs scripts/install-engine-stack.sh and
# scripts/install-kube.sh. The versions and paths are pinned in scripts/tools.env and nowhere else.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 1>&2  # progress goes to stderr: `make render` prints only manifests on stdout

. scripts/tools.env  # HELM*, PROMETHEUS_*, OTELCOL_*
install_helm() { # major version, version, binary path: 4 "$HELM4_VERSION" "$HELM4"
  local major=$1 version=$2 dir
  dir="$PWD/$(dirname "$3")"  # absolute: go install wants an absolute GOBIN
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
  local version=$PROMETHEUS_VERSION dir="$PWD/$PROMETHEUS_DIR" module=github.com/prometheus/prometheus
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

install_otelcol() { # the collector's builder (ocb) writes a main module naming these components, then builds it
  local dir="$PWD/$OTELCOL_DIR" stamp="$OTELCOL_VERSION $OTELCOL_STABLE_VERSION"
  if [ -x "$dir/otelcol-pd" ] && [ "$(cat "$dir/.version" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  command -v go >/dev/null || { echo "install-tools: Go is needed to build the OpenTelemetry Collector (none on PATH)" >&2; exit 1; }
  echo "install-tools: building the OpenTelemetry Collector $OTELCOL_VERSION (OTLP receiver, file and nop exporters) with its builder (first run only, a few minutes)"
  rm -rf "$dir" && mkdir -p "$dir/src"
  GOBIN="$dir" GOFLAGS=-mod=mod go install "go.opentelemetry.io/collector/cmd/builder@$OTELCOL_VERSION"
  cat > "$dir/manifest.yaml" <<MANIFEST
dist:
  name: otelcol-pd
  description: OpenTelemetry Collector for pd-inference's tests and benchmarks
  output_path: $dir/src
  version: ${OTELCOL_VERSION#v}
receivers:
  - gomod: go.opentelemetry.io/collector/receiver/otlpreceiver $OTELCOL_VERSION
exporters:
  - gomod: github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter $OTELCOL_VERSION
  - gomod: go.opentelemetry.io/collector/exporter/nopexporter $OTELCOL_VERSION
providers:
  - gomod: go.opentelemetry.io/collector/confmap/provider/envprovider $OTELCOL_STABLE_VERSION
  - gomod: go.opentelemetry.io/collector/confmap/provider/fileprovider $OTELCOL_STABLE_VERSION
MANIFEST
  GOFLAGS=-mod=mod "$dir/builder" --config "$dir/manifest.yaml"
  mv "$dir/src/otelcol-pd" "$dir/otelcol-pd"
  echo "$stamp" > "$dir/.version"
}

helm_ready() { # version, binary path
  echo "install-tools: helm $1 ($("$2" version --template '{{.GoVersion}}')) at $2"
}

# llm-d-inference-sim: its installer (router/tools/install-llm-d-sim.sh) exits 0 and writes
# .tools/llm-d-inference-sim/UNAVAILABLE when the module cannot be had. A refusal by the module
# proxy (403/404/410: "not available") will not change by retrying, so it is remembered in
# $SIM_REFUSED, keyed by the installer's content (a new pin retries), and not fetched again.
SIM_INSTALLER=router/tools/install-llm-d-sim.sh
SIM_REFUSED=.tools/llm-d-inference-sim.refused
install_llm_d_sim() {
  [ -x "$SIM_INSTALLER" ] || return 0
  local key note=.tools/llm-d-inference-sim/UNAVAILABLE
  key="$(sha256sum "$SIM_INSTALLER" | cut -c1-16) ${LLM_D_SIM_VERSION:-default}"
  if [ "$(head -n1 "$SIM_REFUSED" 2>/dev/null)" = "$key" ]; then
    echo "install-tools: llm-d-inference-sim skipped: the Go module proxy refused it before (rm $SIM_REFUSED to retry); its interop test skips and says why"
    return 0
  fi
  local out
  out=$("$SIM_INSTALLER" 2>&1) || true
  if [ -f "$note" ] && grep -qiE "403 Forbidden|404 Not Found|410 Gone|not available" "$note"; then
    printf '%s\n%s\n' "$key" "$(cat "$note")" > "$SIM_REFUSED"
    echo "install-tools: llm-d-inference-sim not installed: the Go module proxy refuses it (remembered in $SIM_REFUSED); its interop test skips and says why"
  elif [ -f "$note" ]; then
    echo "install-tools: llm-d-inference-sim not installed ($(head -c 300 "$note")); its interop test skips and says why"
  else
    rm -f "$SIM_REFUSED"
    echo "install-tools: ${out##*$'\n'}"
  fi
}

# What to install: `helm` (both versions; `helm4` or `helm3` for one), `checkov`, `prometheus`,
# `otelcol`, `llm-d-sim`; no argument = all five.
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(helm checkov prometheus otelcol llm-d-sim)
for part in "${parts[@]}"; do
  case "$part" in
    helm)
      install_helm 4 "$HELM4_VERSION" "$HELM4"
      install_helm 3 "$HELM3_VERSION" "$HELM3"
      helm_ready "$HELM4_VERSION" "$HELM4"
      helm_ready "$HELM3_VERSION" "$HELM3"
      ;;
    helm4)
      install_helm 4 "$HELM4_VERSION" "$HELM4"
      helm_ready "$HELM4_VERSION" "$HELM4"
      ;;
    helm3)
      install_helm 3 "$HELM3_VERSION" "$HELM3"
      helm_ready "$HELM3_VERSION" "$HELM3"
      ;;
    checkov)
      # checkov (the CI security scan) lives in its own virtualenv: see scripts/install-checkov.sh.
      scripts/install-checkov.sh
      echo "install-tools: $(.tools/checkov-venv/bin/checkov --version | sed 's/^/checkov /') at .tools/checkov-venv"
      ;;
    prometheus)
      install_prometheus
      echo "install-tools: $("$PROMETHEUS_DIR/prometheus" --version | head -1) at $PROMETHEUS_DIR/{prometheus,promtool}"
      ;;
    otelcol)
      install_otelcol
      # next to the virtualenv's interpreter, where pd_router_dev.otelcol finds it (as it finds
      # vllm-router): the dev package reads no pin file; this link follows the pin
      if [ -d .venv/bin ]; then ln -sfn "$PWD/$OTELCOL_DIR/otelcol-pd" .venv/bin/otelcol-pd; fi
      echo "install-tools: $("$OTELCOL_DIR/otelcol-pd" --version) at $OTELCOL_DIR/otelcol-pd"
      ;;
    llm-d-sim) install_llm_d_sim ;;
    *) echo "install-tools: unknown part $part (helm, helm4, helm3, checkov, prometheus, otelcol, llm-d-sim)"; exit 2 ;;
  esac
done
