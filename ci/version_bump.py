"""Chart version bump check: when the chart's templates/, values.yaml or values.schema.json differ
from the base, Chart.yaml's `version` must differ too (and be higher). chart-testing's `ct lint`
does this too, but wants a git remote and its own Python tools; this is 100 lines over `git`.

The base is, in order: $BASE_REF (CI sets it to the pull request's target, e.g. origin/main);
origin/main when it is not the checked-out commit; the newest release tag (`v<chart version>`,
what .github/workflows/release.yaml publishes) reachable from HEAD, so main itself is checked
against what users already have. The working tree is compared, so uncommitted edits count. With no
base (nothing released yet, or a shallow clone) it says it skipped and why, and passes; a BASE_REF
that is not a commit fails, so a misconfigured CI cannot pass silently.

    python -m ci.version_bump            # exit 1 when a bump is missing
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = "charts/pd-inference"
WATCHED = [f"{CHART}/templates", f"{CHART}/values.yaml", f"{CHART}/values.schema.json"]


def git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)


def _commit(repo: Path, ref: str) -> str | None:
    proc = git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return proc.stdout.strip() if proc.returncode == 0 else None


def pick_base(repo: Path, env: dict[str, str]) -> tuple[str | None, str]:
    """(base ref or None, why)."""
    head = _commit(repo, "HEAD")
    if env.get("BASE_REF"):
        if _commit(repo, env["BASE_REF"]) is None:
            return None, f"BASE_REF={env['BASE_REF']} is not a commit here (fetch it: git fetch origin main)"
        return env["BASE_REF"], "BASE_REF"
    origin = _commit(repo, "origin/main")
    if origin and origin != head:
        base = git(repo, "merge-base", "origin/main", "HEAD").stdout.strip() or "origin/main"
        return base, "merge base with origin/main"
    tag = git(repo, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*", "HEAD")
    if tag.returncode == 0 and tag.stdout.strip():
        return tag.stdout.strip(), f"last release tag {tag.stdout.strip()}"
    return None, "no base: no BASE_REF, origin/main is this commit or absent, and no release tag (v*) yet"


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"^version:\s*[\"']?(\d+)\.(\d+)\.(\d+)", text, re.M)
    return tuple(map(int, m.groups())) if m else None


def check(repo: Path, base: str) -> tuple[bool, str]:
    changed = git(repo, "diff", "--name-only", base, "--", *WATCHED).stdout.split()
    untracked = git(repo, "ls-files", "--others", "--exclude-standard", "--", *WATCHED).stdout.split()
    changed += untracked
    if not changed:
        return True, f"no change to the chart's templates or values against {base}"
    old_text = git(repo, "show", f"{base}:{CHART}/Chart.yaml")
    if old_text.returncode != 0:
        return True, f"the chart is new since {base}"
    old = parse_version(old_text.stdout)
    new = parse_version((repo / CHART / "Chart.yaml").read_text())
    files = ", ".join(sorted(set(changed))[:5]) + (" ..." if len(set(changed)) > 5 else "")
    if new is None:
        return False, f"{CHART}/Chart.yaml: no semantic version"
    if old == new:
        return False, (
            f"{CHART}/Chart.yaml version is still {'.'.join(map(str, new))} but {files} changed against {base}: "
            "bump it (major for a change Kubernetes cannot apply in place, see tests/test_upgrade_safety.py)"
        )
    if old is not None and new < old:
        return False, f"{CHART}/Chart.yaml version went down: {'.'.join(map(str, old))} -> {'.'.join(map(str, new))}"
    return (
        True,
        f"chart changed against {base} and its version went {'.'.join(map(str, old or ()))} -> {'.'.join(map(str, new))}",
    )


def main(repo: Path = ROOT, env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    base, why = pick_base(repo, env)
    if base is None and env.get("BASE_REF"):
        print(f"FAILED: {why}", file=sys.stderr)
        return 1
    if base is None:
        print(f"skipped: {why}")
        return 0
    ok, message = check(repo, base)
    print(f"{'ok' if ok else 'FAILED'}: {message} (base: {why})", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
