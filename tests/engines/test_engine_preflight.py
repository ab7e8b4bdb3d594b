"""The engine preflight (charts/pd-inference/files/preflight.py) with the real NIXL 1.5.1 and
LMCache 0.5.6 of the engine stack, run with the arguments the chart renders. A stand-in engine
(a Python one-liner) replaces `vllm serve`, so a passing preflight is seen to exec it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests import helm
from tests.cases import LMCACHE
from tests.engines import stack

# One worker runs the whole module: its real-stack harness runs once, cached (pytest-xdist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-preflight")

ENGINE = "ENGINE STARTED"
PREFIX = "pd-inference preflight: "


def rendered_command(files: tuple[str, ...] = (), sets: tuple[str, ...] = (), role: str = "decode") -> list[str]:
    """The preflight part of the rendered engine command, pointed at this checkout's file."""
    docs = helm.render(helm.helm_binaries()[0], files, sets)
    command = helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[1] == "/etc/pd-inference/preflight.py" and command[-3:] == ["--", "vllm", "serve"]
    return command[2:-3]


def lmcache_yaml(role: str = "decode", **changes: object) -> str:
    docs = helm.render(helm.helm_binaries()[0], (LMCACHE,))
    cfg = yaml.safe_load(helm.one(docs, "ConfigMap", f"-{role}-lmcache")["data"]["lmcache.yaml"])
    cfg.update(changes)
    return yaml.safe_dump({k: v for k, v in cfg.items() if v is not None})


def preflight(
    args: list[str], tmp_path: Path, config: str | None = None, python: Path | None = None, vllm: str | None = "0.31.0"
) -> subprocess.CompletedProcess[str]:
    env = stack.env(vllm)
    if config is not None:
        (tmp_path / "lmcache.yaml").write_text(config)
        env["LMCACHE_CONFIG_FILE"] = str(tmp_path / "lmcache.yaml")
    exe = str(python or stack.python())
    return subprocess.run(
        [exe, str(stack.PREFLIGHT), *args, "--", exe, "-c", f"print({ENGINE!r})"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def failure_line(proc: subprocess.CompletedProcess[str]) -> str:
    """A failed preflight says one line, and the engine never starts."""
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert ENGINE not in proc.stdout
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(PREFIX + "FAILED: ")
    return lines[0].removeprefix(PREFIX + "FAILED: ")


def test_ucx_passes_and_execs_the_engine(tmp_path: Path) -> None:
    args = rendered_command()  # chart defaults: NixlConnector over UCX, no EFA
    assert "--backend=UCX" in args and "--connector=nixl" in args
    proc = preflight(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ENGINE  # exec'd: the engine's output is all that follows
    assert proc.stderr.strip() == f"{PREFIX}ok (connector=nixl, backend=UCX, nixl 1.5.1, vllm 0.31.0)"


def test_libfabric_without_libfabric_names_the_value_and_the_missing_library(tmp_path: Path) -> None:
    args = rendered_command(sets=("kvTransfer.backend=LIBFABRIC",))
    line = failure_line(preflight(args, tmp_path))
    # This machine has no libfabric (nor hwloc, nor a GPU driver): NIXL's LIBFABRIC plugin cannot load.
    assert line.startswith("kvTransfer.backend resolves to LIBFABRIC, but the image's NIXL cannot create it: ")
    assert line.endswith(" not found")
    assert "libfabric.so.1" in line and "libhwloc.so.15" in line


def test_efa_on_without_efa_devices(tmp_path: Path) -> None:
    args = rendered_command(("values/profiles/qwen3.5-9b-g6.yaml",))
    assert "--efa-devices=1" in args and "--backend=LIBFABRIC" in args
    line = failure_line(preflight(args, tmp_path))
    assert line.startswith("efa.enabled is true, but no EFA device is visible in the pod")


def test_lmcache_passes_with_the_rendered_config(tmp_path: Path) -> None:
    for role in ("prefill", "decode"):
        proc = preflight(rendered_command((LMCACHE,), role=role), tmp_path, lmcache_yaml(role))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == ENGINE
        assert "connector=lmcache" in proc.stderr and "lmcache 0.5.6" in proc.stderr


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"enable_nixl": True}, "kvTransfer.lmcache.extraConfig: LMCache 0.5.6 does not know enable_nixl"),
        # Without it LMCache overrides the value and warns: the preflight refuses a config LMCache changes.
        ({"save_unfull_chunk": None}, "kvTransfer.lmcache: LMCache changed or ignored the rendered config"),
    ],
)
def test_lmcache_config_the_image_would_not_run_as_rendered(tmp_path: Path, changes: dict, expected: str) -> None:
    proc = preflight(rendered_command((LMCACHE,)), tmp_path, lmcache_yaml(**changes))
    assert failure_line(proc).startswith(expected)


def test_lmcache_config_file_missing(tmp_path: Path) -> None:
    line = failure_line(preflight(rendered_command((LMCACHE,)), tmp_path))
    assert line.startswith("kvTransfer.connector=lmcache: LMCACHE_CONFIG_FILE")


def test_an_image_without_nixl(tmp_path: Path) -> None:
    """The router's virtualenv has no NIXL: as an engine image without it."""
    router_python = stack.ROOT / ".venv" / "bin" / "python"
    line = failure_line(preflight(rendered_command(), tmp_path, python=router_python, vllm=None))
    assert line.startswith("kvTransfer.backend needs NIXL, but the engine image cannot import it")


def test_a_vllm_the_chart_was_not_checked_against_is_named(tmp_path: Path) -> None:
    args = [a if not a.startswith("--checked-vllm=") else "--checked-vllm=0.33.0" for a in rendered_command()]
    proc = preflight(args, tmp_path, vllm="0.31.0")
    assert proc.returncode == 0 and proc.stdout.strip() == ENGINE
    assert "WARNING: the chart was checked against vLLM 0.33.0, not 0.31.0" in proc.stderr
