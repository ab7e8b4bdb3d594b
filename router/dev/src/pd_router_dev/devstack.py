"""Start/stop simulated engines and routers as real processes on loopback (demo, bench, tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path(__file__).with_name("demo-config.yaml")


def static_pools(prefill: Sequence[str], decode: Sequence[str]) -> dict[str, Any]:
    """A router config's ``pools`` with both pools listed statically (no discovery)."""
    return {
        "prefill": {"discovery": "static", "static": list(prefill)},
        "decode": {"discovery": "static", "static": list(decode)},
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port (for ports that must be known before a process starts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path, port: int) -> None:
        self.name = name
        self.popen = popen
        self.log = log
        self.port = port

    @property
    def pid(self) -> int:
        return self.popen.pid

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        # whatever it started (a router's workers) goes with it: it leads its own session
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def pinned(cpus: Collection[int] | None, batch: bool = False) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child (and whatever it starts) to ``cpus`` before exec;
    None leaves it where it is. ``batch``: SCHED_BATCH as well, so that it never preempts
    the task running when it wakes up (two processes sharing a CPU then take turns by the
    batch, not by the message)."""
    if not cpus and not batch:
        return None
    chosen = set(cpus or ())

    def pin() -> None:
        if chosen:
            os.sched_setaffinity(0, chosen)
        if batch:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))

    return pin


def _spawn(
    name: str,
    args: Sequence[str],
    workdir: Path,
    env: Mapping[str, str] | None = None,
    cpus: Collection[int] | None = None,
) -> Proc:
    port_file = workdir / f"{name}.port"
    with contextlib.suppress(FileNotFoundError):
        port_file.unlink()
    log = workdir / f"{name}.log"
    full_env = dict(os.environ)
    full_env.update(env or {})
    with open(log, "wb") as lf:
        popen = subprocess.Popen(
            [*args, "--port-file", str(port_file)],
            stdout=lf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
            preexec_fn=pinned(cpus),  # noqa: PLW1509 - sched_setaffinity only
        )
    proc = Proc(name, popen, log, 0)
    deadline = time.monotonic() + 60
    try:  # whatever ends the wait (its limit, an exit, Ctrl-C, a test's timeout) stops it first
        while not port_file.exists():
            if popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {popen.returncode}:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start in 60 s:\n{proc.log_tail()}")
            time.sleep(0.02)
    except BaseException:
        proc.stop()
        raise
    proc.port = int(port_file.read_text())
    return proc


def vllm_router_binary() -> Path:
    """The Rust ``vllm-router`` from PyPI (``pd-router[test]``), next to this interpreter."""
    import shutil

    return Path(shutil.which("vllm-router") or Path(sys.executable).with_name("vllm-router"))


def _vllm_router(mode: Sequence[str], port: int, extra: Sequence[str]) -> list[str]:
    """``vllm-router`` (0.1.17) on 127.0.0.1:port, round robin, warnings only, its Prometheus
    exporter on a free port (its default, 29000, is one per machine: a second vllm-router, as
    two pytest workers start, panics with "Address already in use")."""
    return [
        str(vllm_router_binary()),
        *mode,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--prometheus-port",
        str(free_port()),
        *extra,
    ]


def vllm_router_regular_command(worker_urls: Sequence[str], port: int, *extra: str) -> list[str]:
    """Its regular mode (no disaggregation) over ``worker_urls``: the peer of our router's
    direct route in ``make bench``."""
    return _vllm_router(["--worker-urls", *worker_urls], port, extra)


def vllm_router_command(prefill_url: str, decode_url: str, port: int, *extra: str) -> list[str]:
    """Its NIXL PD mode: the peer that ``make bench`` measures against and that the
    simulator's interop test uses."""
    mode = ["--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url]
    return _vllm_router(mode, port, extra)


def start_sim(name: str, workdir: Path, *args: str, cpus: Collection[int] | None = None) -> Proc:
    return _spawn(name, [sys.executable, "-m", "pd_router_dev.sim", *args], workdir, cpus=cpus)


def start_router(
    name: str,
    workdir: Path,
    config: Path | str,
    env: Mapping[str, str] | None = None,
    cpus: Collection[int] | None = None,
) -> Proc:
    return _spawn(
        name,
        [sys.executable, "-m", "pd_router", "serve", "--config", str(config)],
        workdir,
        env,
        cpus,
    )


def start_notify_sidecar(name: str, workdir: Path, zmq_port: int, *args: str) -> Proc:
    """``pd-router notify-sidecar`` on a free HTTP port, ZMQ PULL on 127.0.0.1:zmq_port."""
    return _spawn(
        name,
        [
            sys.executable,
            "-m",
            "pd_router",
            "notify-sidecar",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--zmq-bind",
            f"tcp://127.0.0.1:{zmq_port}",
            *args,
        ],
        workdir,
    )


def start_metrics_proxy(name: str, workdir: Path, upstream_port: int, *args: str) -> Proc:
    """``pd-router metrics-proxy`` on a free port of 127.0.0.1 for
    ``http://127.0.0.1:upstream_port`` (``args`` may override any of them)."""
    return _spawn(
        name,
        [
            sys.executable,
            "-m",
            "pd_router",
            "metrics-proxy",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--upstream",
            f"http://127.0.0.1:{upstream_port}",
            *args,
        ],
        workdir,
    )


class Stack:
    """A group of processes stopped together (context manager)."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pd-stack-")
            workdir = Path(self._tmp.name)
        self.workdir = workdir
        self.procs: list[Proc] = []

    def sim(self, name: str, *args: str, cpus: Collection[int] | None = None) -> Proc:
        p = start_sim(name, self.workdir, *args, cpus=cpus)
        self.procs.append(p)
        return p

    def router(
        self,
        name: str,
        config: Path | str,
        env: Mapping[str, str] | None = None,
        cpus: Collection[int] | None = None,
    ) -> Proc:
        p = start_router(name, self.workdir, config, env, cpus)
        self.procs.append(p)
        return p

    def adopt(self, proc: Proc) -> Proc:
        """Stop ``proc`` with the others (a process started some other way)."""
        self.procs.append(proc)
        return proc

    def notify_sidecar(self, name: str, zmq_port: int, *args: str) -> Proc:
        p = start_notify_sidecar(name, self.workdir, zmq_port, *args)
        self.procs.append(p)
        return p

    def metrics_proxy(self, name: str, upstream_port: int, *args: str) -> Proc:
        p = start_metrics_proxy(name, self.workdir, upstream_port, *args)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
