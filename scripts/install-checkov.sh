#!/usr/bin/env bash
# Installs checkov into its own virtualenv, .tools/checkov-venv (git-ignored), idempotently.
# checkov pulls ~90 packages with tight upper bounds (packaging<24, boto3, networkx<2.7, ...) that
# would downgrade or fight the test venv and the router's pins, so it lives apart from .venv.
# The full dependency set is pinned in ci/checkov-requirements.txt (regenerate: see that file).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/tools.env  # PIP_VERSION
exec 1>&2
PYTHON=${PYTHON:-python3.11}
VENV=.tools/checkov-venv
REQ=ci/checkov-requirements.txt
stamp="$VENV/.installed"
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ -x "$VENV/bin/checkov" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "install-checkov: installing $(grep -m1 '^checkov==' "$REQ") into $VENV (first run only, about a minute)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade "pip==$PIP_VERSION"
"$VENV/bin/python" -m pip install --quiet --no-deps -r "$REQ"
"$VENV/bin/python" -m pip check >/dev/null
echo "$want" > "$stamp"
echo "install-checkov: $("$VENV/bin/checkov" --version) at $VENV/bin/checkov"
