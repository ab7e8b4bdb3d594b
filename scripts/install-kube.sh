#!/usr/bin/env bash
# Builds the Kubernetes control plane the cluster test tier (tests/cluster/) runs on loopback,
# idempotently, into the git-ignored .tools/:
#   kube-<version>/   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#   etcd-<version>/etcd, kwok-<version>/kwok
#   lws-<version>/    the LeaderWorkerSet controller, and the upstream files the tests install
#                     with it: its webhook configurations, ClusterRole and DisaggregatedSet CRD
# and writes .tools/kube.json (what the tests read: versions and paths).
# Versions are pinned here and nowhere else.
#
# How, since `go install k8s.io/kubernetes/cmd/...@v` is refused (its go.mod replaces every
# k8s.io/<staging> module with ./staging/src/..., which the module zip does not carry): copy the
# downloaded module, drop those replaces and require the published k8s.io/<staging> v0.<minor>.<patch>
# instead, then build with the version ldflags (or the server reports v0.0.0 and Helm's
# kubeVersion check fails). etcd's server module has the same replaces; built as a dependency of
# a scratch module they are ignored. kwok installs directly; LWS builds in a scratch module too
# (`go install sigs.k8s.io/lws/cmd@v` is refused: it needs the proxy's @v/list). First run: about
# 22 minutes on two cores and 5 GB of Go build cache; later runs compare stamps and return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 1>&2

# The Kubernetes versions the cluster tier runs on: the newest the module proxy serves, and the
# oldest (it has nothing before 1.34). These are tested versions, not the chart's minimum: that is
# Chart.yaml kubeVersion (ci/lib.py KUBE_MIN), which Helm is told and every object is validated against offline.
KUBE_VERSIONS=(v1.37.2 v1.34.0)
ETCD_VERSION=v3.7.3
KWOK_VERSION=v0.8.0
# The LeaderWorkerSet controller (kubernetes-sigs/lws). v0.9.0, not v0.10.0: the module proxy
# serves v0.10.0's .info but refuses its zip (403 "not available"). Its CRD is ci/crds/lws-v0.9.0/.
LWS_VERSION=v0.9.0

TOOLS="$PWD/.tools"
BUILD="$TOOLS/build"
export GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0
command -v go >/dev/null || { echo "install-kube: Go is needed to build the control plane (none on PATH)"; exit 1; }

stamped() { [ "$(cat "$1/.version" 2>/dev/null)" = "$2" ]; }

build_kube() { # v1.37.2
  local version=$1 dir="$TOOLS/kube-$1" staging minor src
  stamped "$dir" "$version" && return 0
  started=$(date +%s)
  echo "install-kube: building Kubernetes $version (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl; first run only, about 10 minutes)"
  src=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  rm -rf "$BUILD/kubernetes-$version"
  mkdir -p "$BUILD" "$dir"
  cp -r "$src" "$BUILD/kubernetes-$version"
  chmod -R u+w "$BUILD/kubernetes-$version"
  cd "$BUILD/kubernetes-$version"
  staging="v0.${version#v1.}"
  local edits=()
  for module in $(sed -n 's/^[[:space:]]*\(k8s\.io\/[a-z0-9.-]*\) => \.\/staging\/.*/\1/p' go.mod); do
    edits+=("-dropreplace=$module" "-require=$module@$staging")
  done
  go mod edit "${edits[@]}"
  minor=${version#v1.}
  minor=${minor%%.*}
  local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version"
  ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ldflags+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    echo "install-kube:   $cmd $version"
    go build -trimpath -ldflags "$ldflags" -o "$dir/$cmd" "./cmd/$cmd"
  done
  cd - >/dev/null
  rm -rf "$BUILD/kubernetes-$version"
  echo "$version" > "$dir/.version"
  echo "install-kube: Kubernetes $version built in $(( $(date +%s) - started )) s"
}

build_etcd() {
  local dir="$TOOLS/etcd-$ETCD_VERSION"
  stamped "$dir" "$ETCD_VERSION" && return 0
  echo "install-kube: building etcd $ETCD_VERSION (first run only, about a minute)"
  rm -rf "$BUILD/etcd" && mkdir -p "$BUILD/etcd" "$dir"
  (
    cd "$BUILD/etcd"
    go mod init pd-inference.local/etcd-build >/dev/null 2>&1
    go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    go build -trimpath -o "$dir/etcd" go.etcd.io/etcd/server/v3
  )
  rm -rf "$BUILD/etcd"
  echo "$ETCD_VERSION" > "$dir/.version"
}

build_kwok() {
  local dir="$TOOLS/kwok-$KWOK_VERSION"
  stamped "$dir" "$KWOK_VERSION" && return 0
  echo "install-kube: building kwok $KWOK_VERSION (first run only, about two minutes)"
  mkdir -p "$dir"
  GOBIN="$dir" go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  echo "$KWOK_VERSION" > "$dir/.version"
}

build_lws() {
  local dir="$TOOLS/lws-$LWS_VERSION" src started
  stamped "$dir" "$LWS_VERSION" && return 0
  started=$(date +%s)
  echo "install-kube: building the LeaderWorkerSet controller $LWS_VERSION (first run only, about two minutes)"
  rm -rf "$BUILD/lws" "$dir" && mkdir -p "$BUILD/lws" "$dir"
  (
    cd "$BUILD/lws"
    go mod init pd-inference.local/lws-build >/dev/null 2>&1
    go mod edit "-require=sigs.k8s.io/lws@$LWS_VERSION"
    go build -trimpath -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" -o "$dir/lws" sigs.k8s.io/lws/cmd
  )
  rm -rf "$BUILD/lws"
  # What tests/cluster/controlplane.py installs besides the binary, under upstream's paths: the
  # webhook configurations (manifests.yaml and the patches that add the pod webhooks'
  # objectSelector), the controller's ClusterRole, and the DisaggregatedSet CRD (the controller
  # always runs that controller too, and exits without its CRD).
  src=$(go mod download -json "sigs.k8s.io/lws@$LWS_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  for file in config/webhook/manifests.yaml config/webhook/mutating-patch.yaml config/webhook/validating-patch.yaml \
    config/rbac/role.yaml config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml; do
    mkdir -p "$dir/$(dirname "$file")"
    cp "$src/$file" "$dir/$file"
  done
  chmod -R u+w "$dir"
  echo "$LWS_VERSION" > "$dir/.version"
  echo "install-kube: LeaderWorkerSet $LWS_VERSION built in $(( $(date +%s) - started )) s"
}

for version in "${KUBE_VERSIONS[@]}"; do build_kube "$version"; done
build_etcd
build_kwok
build_lws

# What tests/cluster reads: one place for the versions above, resolved to paths.
{
  printf '{\n  "kubernetes": {'
  sep=""
  for version in "${KUBE_VERSIONS[@]}"; do printf '%s"%s": "%s"' "$sep" "$version" "$TOOLS/kube-$version"; sep=", "; done
  printf '},\n  "etcd": "%s",\n  "kwok": "%s",\n' "$TOOLS/etcd-$ETCD_VERSION/etcd" "$TOOLS/kwok-$KWOK_VERSION/kwok"
  printf '  "lws": {"version": "%s", "bin": "%s", "config": "%s"}\n}\n' \
    "$LWS_VERSION" "$TOOLS/lws-$LWS_VERSION/lws" "$TOOLS/lws-$LWS_VERSION/config"
} > "$TOOLS/kube.json"
for version in "${KUBE_VERSIONS[@]}"; do
  echo "install-kube: $("$TOOLS/kube-$version/kube-apiserver" --version) at .tools/kube-$version"
done
