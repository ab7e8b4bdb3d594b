"""The CLI, the example config and `make demo` (python -m pd_router_dev.demo --once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from router_testlib import run_cli, write_config

ROUTER_DIR = Path(__file__).resolve().parents[1]


def test_check_config_ok() -> None:
    out = run_cli("check-config", "--config", str(ROUTER_DIR / "config.example.yaml"))
    assert out.returncode == 0, out.stderr
    assert "servedName: llama-3.3-70b" in out.stdout


def test_bad_config_exits_2_naming_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: {threshold: lots}\n")
    for cmd in ("check-config", "serve"):
        out = run_cli(cmd, "--config", str(bad))
        assert out.returncode == 2
        assert "routing.threshold" in out.stderr


def test_env_override_error_names_field(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PD_ROUTER__LIMITS__MAXINFLIGHT": "zero"}
    out = run_cli("check-config", "--config", str(ROUTER_DIR / "config.example.yaml"), env=env)
    assert out.returncode == 2 and "limits.maxInFlight" in out.stderr


def test_demo_once() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pd_router_dev.demo", "--once"],
        capture_output=True,
        check=False,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "route=direct reason=below_threshold" in out.stdout
    assert "route=disaggregated reason=above_threshold" in out.stdout
    assert "[next-turn request" in out.stdout and "route=direct reason=prefix_cached" in out.stdout
    assert "TTFT=" in out.stdout and "engines are simulated" in out.stdout
    # a default install's model and connector (the chart's defaults)
    chart = yaml.safe_load(
        (ROUTER_DIR.parent / "charts" / "pd-inference" / "values.yaml").read_text()
    )
    assert f"model           {chart['model']['servedName']}" in out.stdout
    assert f"connector={chart['kvTransfer']['connector']}" in out.stdout


def test_demo_with_an_api_key(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pd_router_dev.demo", "--once", "--api-key", "s3cret"],
        capture_output=True,
        check=False,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "route=disaggregated reason=above_threshold" in out.stdout


def test_demo_port_model_and_kept_logs(tmp_path: Path) -> None:
    from pd_router_dev.devstack import free_port

    port = free_port()
    logs = tmp_path / "logs"
    args = ["--once", "--connector", "nixl", "--port", str(port), "--model", "my-model"]
    out = subprocess.run(
        [sys.executable, "-m", "pd_router_dev.demo", *args, "--logs", str(logs)],
        capture_output=True,
        check=False,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"router          http://127.0.0.1:{port}" in out.stdout
    assert "model           my-model" in out.stdout and "route=disaggregated" in out.stdout
    assert f"logs (kept): {logs}" in out.stdout and "/metrics" not in out.stdout
    assert {f.name for f in logs.glob("*.log")} == {
        "demo-prefill.log",
        "demo-decode.log",
        "demo-router.log",
    }
    bad = subprocess.run(
        [sys.executable, "-m", "pd_router_dev.demo", "--port", "70000"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--port: must be between 0 and 65535" in bad.stderr


def test_busy_lmcache_notify_port_stops_start_up(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = write_config(tmp_path, "busy", {"lmcache": {"notifyPort": port}})
        out = run_cli("serve", "--config", str(cfg))
    assert out.returncode == 1, out.stderr
    assert "cannot start: cannot bind lmcache.notifyPort" in out.stderr
    assert "Traceback" not in out.stderr


def test_busy_listen_port_stops_start_up_with_one_clear_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = write_config(tmp_path, "busy-listen", {"listen": {"host": "127.0.0.1", "port": port}})
        out = run_cli("serve", "--config", str(cfg))
    assert out.returncode == 1
    assert "pd-router: cannot start:" in out.stderr and "address already in use" in out.stderr
    # nothing left open behind the message (aiohttp warns about an unclosed client session)
    assert "Unclosed" not in out.stderr + out.stdout
