"""Validate every values file, and every environment's layering, against the chart's values.schema.json.

Each check merges like Helm (chart values.yaml, then the files in order: maps merge, anything else
is replaced, `null` removes the key) and validates the result, so a wrong key or value is reported
with the file(s) and the JSON pointer of the field, e.g.

    values/prod.yaml: /decode/replicas: -1 is less than the minimum of 0

    python -m ci.values_check                 # values/**/*.yaml and argocd/environments/*.yaml
    python -m ci.values_check FILE [FILE...]  # one layering (chart defaults, then the files in order)
    python -m ci.values_check --root DIR      # the first form on another checkout (tests)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ci import lib

ROOT = lib.ROOT
CHART = lib.CHART


def _pointer(path: Any) -> str:
    return "/" + "/".join(str(p) for p in path)


def errors_for(files: list[Path], chart: Path = CHART) -> list[str]:
    """Schema errors of chart defaults + files, each naming the field as a JSON pointer."""
    schema = json.loads((chart / "values.schema.json").read_text())
    values = yaml.safe_load((chart / "values.yaml").read_text()) or {}
    for f in files:
        layer = yaml.safe_load(f.read_text())
        if layer is None:
            continue
        if not isinstance(layer, dict):
            return [f"{f}: top level must be a map, got {type(layer).__name__}"]
        values = lib.deep_merge(values, layer)  # Helm's layering: later wins, null deletes
    validator = jsonschema.Draft7Validator(schema)
    out = []
    for err in sorted(validator.iter_errors(values), key=lambda e: (list(map(str, e.absolute_path)), e.message)):
        where = _pointer(err.absolute_path)
        if err.validator == "additionalProperties":
            # Name the unknown key in the pointer too: /prefill/replicsa rather than /prefill.
            extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
            where = " ".join(f"{_pointer(err.absolute_path).rstrip('/')}/{k}" for k in extra) or where
        out.append(f"{where}: {err.message}")
    return out


def main(argv: list[str]) -> int:
    failed = False
    root = ROOT
    if argv[:1] == ["--root"]:
        root, argv = Path(argv[1]).resolve(), argv[2:]
    chart = root / "charts" / "pd-inference"
    if argv:
        layerings = {" + ".join(argv): [Path(a) for a in argv]}
    else:
        layerings = {str(p.relative_to(root)): [p] for p in sorted((root / "values").rglob("*.yaml"))}
        for name, env in lib.environments(root).items():
            layerings[f"environment {name} ({' + '.join(env['valueFiles'])})"] = [root / f for f in env["valueFiles"]]
    for name, files in layerings.items():
        errors = errors_for(files, chart)
        for e in errors:
            print(f"{name}: {e}", file=sys.stderr)
        failed |= bool(errors)
        if not errors:
            print(f"ok: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
