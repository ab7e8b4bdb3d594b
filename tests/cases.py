"""The values files and environment layerings every test renders."""

from __future__ import annotations

from pathlib import Path

from ci import envs

ROOT = Path(__file__).resolve().parent.parent

VALUES_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "values").rglob("*.yaml"))
# Each environment's layering (profile + env) as Argo CD applies it, plus the documented pairs.
LAYERINGS: dict[str, tuple[str, ...]] = {"defaults": ()}
LAYERINGS.update({f: (f,) for f in VALUES_FILES})
LAYERINGS.update({f"env:{name}": tuple(env["valueFiles"]) for name, env in envs.load().items()})
LAYERINGS["profile:qwen-g6+prod"] = ("values/profiles/qwen3.5-9b-g6.yaml", "values/prod.yaml")
LAYERINGS["profile:llama-p5+dev"] = ("values/profiles/llama-3.3-70b-p5.yaml", "values/dev.yaml")
