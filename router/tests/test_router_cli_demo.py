"""The CLI, the example config and `make demo` (python -m pd_router.demo --once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROUTER_DIR = Path(__file__).resolve().parents[1]


def test_check_config_ok() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_router",
            "check-config",
            "--config",
            str(ROUTER_DIR / "config.example.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "servedName: llama-3.3-70b" in out.stdout


def test_bad_config_exits_2_naming_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: {threshold: lots}\n")
    for cmd in ("check-config", "serve"):
        out = subprocess.run(
            [sys.executable, "-m", "pd_router", cmd, "--config", str(bad)],
            capture_output=True,
            check=False,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2
        assert "routing.threshold" in out.stderr


def test_env_override_error_names_field(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PD_ROUTER__LIMITS__MAXINFLIGHT": "zero"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_router",
            "check-config",
            "--config",
            str(ROUTER_DIR / "config.example.yaml"),
        ],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and "limits.maxInFlight" in out.stderr


def test_demo_once() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pd_router.demo", "--once"],
        capture_output=True,
        check=False,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "route=direct" in out.stdout
    assert "route=disaggregated" in out.stdout
    assert "TTFT=" in out.stdout
