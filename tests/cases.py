"""The values files and layerings every test renders: each values file alone, each environment of
the catalog (ci/lib.py environments()) and each named render scenario (tests/scenarios/*.yaml)."""

from __future__ import annotations

from pathlib import Path

import yaml

from ci import lib

ROOT = lib.ROOT
SCENARIOS = ROOT / "tests" / "scenarios"

VALUES_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "values").rglob("*.yaml"))
# LMCache PD with a full-attention model (the chart default model is hybrid, which only
# NixlConnector serves): layer it first in every test of an LMCache-only rule.
LMCACHE = "tests/values/lmcache.yaml"


def scenarios(directory: Path = SCENARIOS) -> dict[str, tuple[str, ...]]:
    """The named render scenarios, `scenario:<file stem>` -> the value files it layers, in order.
    A scenario file holds `valueFiles:` (paths from the repository root, each existing) and nothing else."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        doc = yaml.safe_load(path.read_text())
        files = doc.get("valueFiles") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or set(doc) != {"valueFiles"} or not isinstance(files, list) or not files:
            raise ValueError(
                f"{where}: a scenario is `valueFiles:`, a non-empty list of values files, and nothing else"
            )
        missing = [f for f in files if not isinstance(f, str) or not (ROOT / f).is_file()]
        if missing:
            raise ValueError(f"{where}: valueFiles {missing} do not exist (paths are from the repository root)")
        out[f"scenario:{path.stem}"] = tuple(files)
    return out


# Every layering: the chart defaults, each values file alone (each renders on the defaults), each named
# scenario, and each environment as Argo CD layers it (profile + env).
LAYERINGS: dict[str, tuple[str, ...]] = {"defaults": ()}
LAYERINGS.update({f: (f,) for f in VALUES_FILES})
LAYERINGS.update(scenarios())
LAYERINGS.update({f"env:{name}": tuple(env["valueFiles"]) for name, env in lib.environments().items()})


def model_name(files: tuple[str, ...]) -> str:
    """model.name after layering `files` over the chart defaults (read from the files, not the chart)."""
    name = yaml.safe_load((lib.CHART / "values.yaml").read_text())["model"]["name"]
    for f in files:
        name = ((yaml.safe_load((ROOT / f).read_text()) or {}).get("model") or {}).get("name", name)
    return name
