"""The values files and environment layerings every test renders."""

from __future__ import annotations

from pathlib import Path

import yaml

from ci import envs

ROOT = Path(__file__).resolve().parent.parent

VALUES_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "values").rglob("*.yaml"))
# LMCache PD with a full-attention model (the chart default model is hybrid, which only
# NixlConnector serves): layer it first in every test of an LMCache-only rule.
LMCACHE = "tests/scenarios/lmcache.yaml"
# Values files that cannot render on the chart defaults alone, and the field their error names:
# staging runs LMCache, which cannot serve the default (hybrid) model without its Llama profile.
REFUSED_ALONE = {"values/staging.yaml": "kvTransfer.connector"}
# Each environment's layering (profile + env) as Argo CD applies it, plus the documented pairs.
LAYERINGS: dict[str, tuple[str, ...]] = {"defaults": ()}
LAYERINGS.update({f: (f,) for f in VALUES_FILES if f not in REFUSED_ALONE})
LAYERINGS["scenario:lmcache"] = (LMCACHE,)
LAYERINGS["scenario:lmcache+staging"] = (LMCACHE, "values/staging.yaml")
LAYERINGS.update({f"env:{name}": tuple(env["valueFiles"]) for name, env in envs.load().items()})
LAYERINGS["profile:qwen-g6+prod"] = ("values/profiles/qwen3.5-9b-g6.yaml", "values/prod.yaml")
LAYERINGS["profile:llama-p5+dev"] = ("values/profiles/llama-3.3-70b-p5.yaml", "values/dev.yaml")


def model_name(files: tuple[str, ...]) -> str:
    """model.name after layering `files` over the chart defaults (read from the files, not the chart)."""
    name = yaml.safe_load((ROOT / "charts/pd-inference/values.yaml").read_text())["model"]["name"]
    for f in files:
        name = ((yaml.safe_load((ROOT / f).read_text()) or {}).get("model") or {}).get("name", name)
    return name
