"""The real engine stack (scripts/install-engine-stack.sh, `make engines`): its interpreter, the
vLLM versions the chart is checked against, and how tests run a harness script inside it.

The stack lives apart from .venv (torch, LMCache, NIXL and vLLM pin versions the router's own
dependencies do not share), so every check runs as a subprocess of its Python: a script under
tests/engines/harness/ reads one JSON document on stdin and prints one on its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
STACK = Path(os.environ.get("PD_ENGINE_STACK", ROOT / ".tools" / "engine-stack"))
HARNESS = Path(__file__).resolve().parent / "harness"
CHART_YAML = ROOT / "charts" / "pd-inference" / "Chart.yaml"
PREFLIGHT = ROOT / "charts" / "pd-inference" / "files" / "preflight.py"


def checked(component: str) -> list[str]:
    """Versions Chart.yaml says the chart is checked against (`pd-inference.io/checked-<component>`)."""
    annotations = yaml.safe_load(CHART_YAML.read_text())["annotations"]
    return [v.strip() for v in annotations[f"pd-inference.io/checked-{component}"].split(",")]


VLLM_VERSIONS = checked("vllm")


def python() -> Path:
    exe = STACK / "venv" / "bin" / "python"
    if not exe.exists():
        raise RuntimeError(f"the real engine stack is not installed at {STACK}: run `make engines` (or `make test`)")
    return exe


def vllm_dir(version: str) -> Path:
    path = STACK / f"vllm-{version}"
    if not path.is_dir():
        raise RuntimeError(f"vLLM {version} is not installed at {path}: run `make engines`")
    return path


def env(vllm: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a harness runs in: no GPU, no network, no telemetry."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "VLLM_", "PYTHON"))}
    out.update(
        VLLM_TARGET_DEVICE="cpu",  # vLLM's CUDA wheel builds its parser on the CPU platform
        # Not HF_HUB_OFFLINE: with it vLLM's EngineArgs swaps the model id for a cached snapshot
        # path (vllm/engine/arg_utils.py __post_init__). Nothing here contacts the hub; should
        # anything try, it gives up fast.
        HF_HUB_ETAG_TIMEOUT="3",
        HF_HUB_DOWNLOAD_TIMEOUT="3",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        LMCACHE_LOG_LEVEL="WARNING",
        PYTHONHASHSEED="0",
    )
    if vllm is not None:
        out["PYTHONPATH"] = str(vllm_dir(vllm))
        # A cache of its own per version: vLLM keeps one file per model class in
        # VLLM_CACHE_ROOT/modelinfos, checked against a hash of the class's module
        # (model_executor/models/registry.py, 0.31.0 and 0.33.0), so two versions sharing one
        # overwrote each other's and each run inspected every architecture again, a subprocess
        # that imports torch each (~10 s): the CLI tier took 100 s a version instead of 15.
        out["VLLM_CACHE_ROOT"] = str(STACK / "cache" / f"vllm-{vllm}")
    out.update(extra or {})
    return out


def run(script: str, payload: Any, *, vllm: str | None = None, timeout: float = 600) -> Any:
    """Run harness/`script` in the engine stack with `payload` on stdin; its JSON answer."""
    proc = subprocess.run(
        [str(python()), str(HARNESS / script)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(vllm),
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1])
