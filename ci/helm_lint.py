"""`helm lint --strict` of the chart with each environment's value files (the catalog,
argocd/environments/), against the oldest supported Kubernetes (Chart.yaml kubeVersion).
chart-testing's `ct lint` lints per values file in `ci/`, not per environment layering.

    python -m ci.helm_lint [--helm PATH] [--kube-version X.Y.Z]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ci import lib


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--helm", default=str(lib.HELM))
    parser.add_argument("--kube-version", help=f"default: {lib.KUBE_MIN} (Chart.yaml kubeVersion)")
    args = parser.parse_args(argv)
    failed = False
    for name, env in lib.environments().items():
        cmd = lib.helm_lint(env["valueFiles"], helm=args.helm, kube_version=args.kube_version or "")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=lib.ROOT)
        if proc.returncode != 0:
            print(f"{name}: helm lint failed:\n{proc.stdout}{proc.stderr}", file=sys.stderr)
            failed = True
            continue
        print(f"ok: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
