"""The real Prometheus (the version scripts/tools.env pins, built by `make tools`):
a server on loopback that scrapes the live stack, and promtool, which checks, tests and queries."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from pd_router_dev.devstack import free_port

from ci import lib

ROOT = lib.ROOT
# The pin and the directory live in scripts/tools.env (PROMETHEUS_VERSION, PROMETHEUS_DIR).
TOOLS = lib.PROMETHEUS_DIR
PROMETHEUS, PROMTOOL = TOOLS / "prometheus", TOOLS / "promtool"
# The chart's Grafana dashboard, whose every panel query the tier proves returns data.
DASHBOARD = lib.CHART / "files" / "dashboards" / "pd-inference.json"
HTTP_TIMEOUT = 10


def require_tools() -> None:
    missing = [str(p) for p in (PROMETHEUS, PROMTOOL) if not p.exists()]
    if missing:
        raise RuntimeError(f"Prometheus tools not installed at {missing}: run `make tools`")


def promtool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=timeout)


class Prometheus:
    """One Prometheus server on 127.0.0.1 with the given scrape configs and rule files."""

    def __init__(self, workdir: Path, scrape_configs: list[dict[str, Any]], rule_files: list[Path]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            # 1s so rate() windows fill within seconds; the monitors' interval is the one field
            # of their endpoints this does not reproduce.
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": scrape_configs,
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        check = promtool("check", "config", "--syntax-only", str(self.config))
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.wait_for(lambda: self._ready(), "ready", 60)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=HTTP_TIMEOUT) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_for(self, condition: Any, what: str, seconds: float) -> Any:
        """Poll until `condition()` is truthy (the server's own state: no fixed sleeps)."""
        deadline = time.monotonic() + seconds
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.popen.returncode}:\n{self.log.read_text()[-3000:]}")
            result = condition()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus: not {what} within {seconds}s")
            time.sleep(0.2)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query through `promtool query instant` (the CLI users run), JSON out."""
        proc = promtool("query", "instant", "-o", "json", self.url, expr, timeout=30)
        assert proc.returncode == 0, f"promtool query instant {expr!r}: {proc.stderr}"
        return json.loads(proc.stdout) if proc.stdout.strip() else []

    def selectors(self, expr: str) -> list[str]:
        """Every vector selector of `expr`, as PromQL, from the server's own parser."""
        found: list[str] = []

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                if node.get("type") in ("vectorSelector", "matrixSelector"):
                    found.append(
                        "{"
                        + ",".join(f"{m['name']}{m['type']}{json.dumps(m['value'])}" for m in node["matchers"])
                        + "}"
                    )
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(self.api("parse_query", query=expr))
        return found

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
