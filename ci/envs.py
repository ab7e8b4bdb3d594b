"""The environments catalog (argocd/environments/*.yaml), shared by Makefile, ci/ and tests.

python ci/envs.py list           # environment names
python ci/envs.py files ENV      # its value files, in layering order
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENTS = ROOT / "argocd" / "environments"


def load() -> dict[str, dict[str, Any]]:
    envs = {}
    for path in sorted(ENVIRONMENTS.glob("*.yaml")):
        env = yaml.safe_load(path.read_text())
        if env.get("name") != path.stem:
            raise SystemExit(f"{path.relative_to(ROOT)}: name must be {path.stem!r}")
        envs[env["name"]] = env
    return envs


def main(argv: list[str]) -> int:
    envs = load()
    if argv[:1] == ["list"]:
        print("\n".join(envs))
        return 0
    if len(argv) == 2 and argv[0] == "files":
        if argv[1] not in envs:
            # No catalog entry: the plain values/<env>.yaml (e.g. a profile tried on its own).
            print(f"values/{argv[1]}.yaml")
            return 0
        print("\n".join(envs[argv[1]]["valueFiles"]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
