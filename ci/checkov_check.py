"""checkov on the rendered manifests of every environment (build/rendered/*.yaml from
`python -m ci.render`), with the skips in ci/checkov-skips.yaml and nowhere else.

checkov runs once over the directory (it is slow to start), from its own virtualenv
(.tools/checkov-venv, installed by scripts/install-checkov.sh). Fails on any finding not covered
by a skip, and on a skip that covers no finding (stale: delete it).

    python -m ci.checkov_check [--dir build/rendered]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SKIPS = ROOT / "ci" / "checkov-skips.yaml"
CHECKOV = ROOT / ".tools" / "checkov-venv" / "bin" / "checkov"


@dataclass(frozen=True)
class Finding:
    check_id: str
    name: str
    resource: str
    file: str

    def __str__(self) -> str:
        return f"{self.check_id} {self.resource} ({self.file}): {self.name}"


def load_skips(path: Path = SKIPS) -> list[dict[str, Any]]:
    skips = yaml.safe_load(path.read_text())["skips"]
    for i, s in enumerate(skips):
        if set(s) - {"id", "reason", "resources"} or not s.get("id") or not str(s.get("reason", "")).strip():
            raise SystemExit(f"{path.name}: skip #{i + 1} needs exactly id, reason and optional resources: {s}")
    ids = [s["id"] for s in skips]
    if len(ids) != len(set(ids)):
        raise SystemExit(f"{path.name}: a check id is listed twice: {ids}")
    return skips


def covers(skip: dict[str, Any], finding: Finding) -> bool:
    if skip["id"] != finding.check_id:
        return False
    patterns = skip.get("resources")
    return patterns is None or any(fnmatch.fnmatchcase(finding.resource, p) for p in patterns)


def triage(findings: list[Finding], skips: list[dict[str, Any]]) -> tuple[list[Finding], list[Finding], list[str]]:
    """(unskipped findings, skipped findings, stale skip descriptions)."""
    failed = [f for f in findings if not any(covers(s, f) for s in skips)]
    skipped = [f for f in findings if f not in failed]
    stale = []
    for s in skips:
        if not any(covers(s, f) for f in findings):
            stale.append(f"{s['id']}")
        for pattern in s.get("resources") or []:
            if not any(s["id"] == f.check_id and fnmatch.fnmatchcase(f.resource, pattern) for f in findings):
                stale.append(f"{s['id']} resource {pattern!r}")
    return failed, skipped, stale


def parse(report: Any) -> list[Finding]:
    reports = report if isinstance(report, list) else [report]
    out = []
    for r in reports:
        if r.get("check_type") not in (None, "kubernetes"):
            continue
        for f in r.get("results", {}).get("failed_checks", []):
            out.append(Finding(f["check_id"], f["check_name"], f["resource"], Path(f["file_path"]).name))
    return out


def run_checkov(directory: Path) -> list[Finding]:
    # Idempotent: returns at once when .tools/checkov-venv matches ci/checkov-requirements.txt.
    if subprocess.run([str(ROOT / "scripts" / "install-checkov.sh")]).returncode != 0:
        raise SystemExit("checkov is not installed: scripts/install-checkov.sh failed")
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise SystemExit(f"no rendered manifests in {directory}: run `python -m ci.render` first")
    proc = subprocess.run(
        [str(CHECKOV), "-d", str(directory), "--framework", "kubernetes", "--output", "json", "--quiet",
         "--compact", "--skip-download"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"checkov failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout)
    if isinstance(report, dict) and "results" not in report and report.get("passed", 0) == 0:
        raise SystemExit(f"checkov found nothing to check in {directory}: {report}")
    return parse(report)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=str(ROOT / "build" / "rendered"))
    args = parser.parse_args(argv)
    skips = load_skips()
    findings = run_checkov(Path(args.dir))
    failed, skipped, stale = triage(findings, skips)
    for s in skips:
        n = sum(1 for f in skipped if covers(s, f))
        print(f"skipped: {s['id']} on {n} resource(s) (ci/checkov-skips.yaml)")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    for s in stale:
        print(f"STALE SKIP: {s} matches no finding any more: delete it from ci/checkov-skips.yaml", file=sys.stderr)
    if failed or stale:
        return 1
    print(f"ok: checkov, {len(skipped)} finding(s) skipped with a documented reason, none unskipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
