"""The committed snapshot of the default render: every change to the chart's output shows up in
review. `make snapshot` (python -m tests.snapshot --update) refreshes it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests import helm

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "default.yaml"


def current() -> str:
    result = helm.template(helm.helm_binaries()[0])
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    return result.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--update", action="store_true", help="rewrite the snapshot")
    args = parser.parse_args()
    text = current()
    if args.update:
        SNAPSHOT.write_text(text)
        print(f"snapshot: wrote {SNAPSHOT.relative_to(helm.ROOT)} ({len(text.splitlines())} lines)")
        return 0
    return 0 if SNAPSHOT.read_text() == text else 1


if __name__ == "__main__":
    sys.exit(main())
