#!/usr/bin/env bash
# Install llm-d-inference-sim (the llm-d project's vLLM simulator, a Go module) into
# .tools/llm-d-inference-sim/ of the repository, for the router's interop test.
# Idempotent: does nothing when the pinned version is already there.
# Exits 0 with a clear message when the module cannot be fetched (the test then skips).
set -euo pipefail

VERSION="${LLM_D_SIM_VERSION:-v0.6.1}"   # llm-d v0.4.0 ships llm-d-inference-sim v0.6.1
MODULE="github.com/llm-d/llm-d-inference-sim/cmd/llm-d-inference-sim"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${ROOT}/.tools/llm-d-inference-sim"
BIN="${DEST}/llm-d-inference-sim"
STAMP="${DEST}/VERSION"
UNAVAILABLE="${DEST}/UNAVAILABLE"

mkdir -p "${DEST}"
if [[ -x "${BIN}" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${VERSION}" ]]; then
  echo "llm-d-inference-sim ${VERSION} already installed at ${BIN}"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  msg="go toolchain not found; cannot build llm-d-inference-sim ${VERSION}"
  echo "${msg}" | tee "${UNAVAILABLE}"
  exit 0
fi
log="$(mktemp)"
if GOBIN="${DEST}" GOFLAGS="${GOFLAGS:-} -mod=mod" go install "${MODULE}@${VERSION}" >"${log}" 2>&1; then
  echo "${VERSION}" > "${STAMP}"
  rm -f "${UNAVAILABLE}"
  echo "installed llm-d-inference-sim ${VERSION} at ${BIN}"
else
  reason="$(tail -n 3 "${log}" | tr '\n' ' ')"
  echo "llm-d-inference-sim ${VERSION} could not be installed with 'go install ${MODULE}@${VERSION}': ${reason}" | tee "${UNAVAILABLE}"
fi
rm -f "${log}"
exit 0
