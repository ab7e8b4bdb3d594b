"""The Go zero-delay engine and load generator of ``make bench`` (``router/dev/fastengine``,
standard library only): built once per version of its source with the Go toolchain on this
machine, cached in ``.tools/fastengine/<hash>/fastengine`` of the checkout (git-ignored).

Both run SCHED_BATCH on the CPUs they share: a batch task never preempts the one running
when it wakes, so the load generator sends all its clients' requests before the engine
answers them, and the engine answers all it has before the load generator reads. Under the
default policy the engine, woken by one client's request, can preempt the load generator
inside that write and answer at once, so that one client finds its answer waiting, loops
without blocking and starves the others: the "256 clients" would be one.

The hash covers every file of the source folder and ``go version``, so editing the source or
changing the toolchain builds a new binary; an unchanged one is reused without running Go.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from pd_router_dev.devstack import Proc, pinned

SOURCE = Path(__file__).resolve().parents[2] / "fastengine"  # router/dev/fastengine
BUILD_SECONDS = 600  # a first build compiles the standard library packages it uses


class BuildError(RuntimeError):
    pass


def _repo_root() -> Path | None:
    root = SOURCE.parents[2]
    return root if (root / "Makefile").exists() and (root / "router").is_dir() else None


def _cache_dir() -> Path:
    root = _repo_root()
    if root is not None:
        return root / ".tools" / "fastengine"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pd-fastengine"


def _go() -> str:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None
    )
    if go is None:
        raise BuildError(
            "the Go toolchain (`go`) is not on PATH: make bench builds its engine with it"
        )
    return go


def _go_env() -> dict[str, str]:
    # the local toolchain only and no module downloads (the source uses the standard library)
    env = dict(os.environ)
    env.update(GOTOOLCHAIN="local", GOPROXY="off", GOFLAGS="-buildvcs=false", CGO_ENABLED="0")
    env.update(GOWORK="off")
    return env


def source_hash(go: str) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in SOURCE.rglob("*") if p.is_file()):
        h.update(f.relative_to(SOURCE).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    ver = subprocess.run(
        [go, "version"], capture_output=True, text=True, check=True, timeout=60, env=_go_env()
    ).stdout.strip()
    h.update(ver.encode())
    return h.hexdigest()[:16]


def binary() -> Path:
    """The fastengine binary for the current source, built first if needed (one line to
    stderr when it builds)."""
    if not (SOURCE / "go.mod").exists():
        raise BuildError(
            f"{SOURCE} holds no Go module: run from a checkout (pip install -e router/dev)"
        )
    go = _go()
    out = _cache_dir() / source_hash(go) / "fastengine"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"fastengine: building {out} (Go, standard library only; first build ~30 s)",
        file=sys.stderr,
        flush=True,
    )
    tmp = out.with_name(f".fastengine.{os.getpid()}")
    try:
        r = subprocess.run(
            [go, "build", "-trimpath", "-o", str(tmp), "."],
            check=False,
            cwd=SOURCE,
            capture_output=True,
            text=True,
            timeout=BUILD_SECONDS,
            env=_go_env(),
        )
    except subprocess.TimeoutExpired:
        raise BuildError(f"go build did not finish in {BUILD_SECONDS} s") from None
    if r.returncode != 0:
        raise BuildError(f"go build failed:\n{r.stdout}{r.stderr}")
    os.replace(tmp, out)
    for old in out.parent.parent.glob("*/fastengine"):  # builds of earlier sources
        if old.parent != out.parent:
            shutil.rmtree(old.parent, ignore_errors=True)
    return out


def start_engine(
    workdir: Path,
    name: str,
    http_ports: int,
    sidecar: bool,
    cpus: Collection[int] | None,
    *extra: str,
) -> tuple[Proc, list[int], int]:
    """Start ``fastengine engine`` with ``http_ports`` engine ports (and a sidecar port);
    returns the process, its engine ports and the sidecar port (0 without one)."""
    port_file = workdir / f"{name}.ports.json"
    with contextlib.suppress(FileNotFoundError):
        port_file.unlink()
    log = workdir / f"{name}.log"
    args = [str(binary()), "engine", "-http", str(http_ports), "-port-file", str(port_file), *extra]
    if sidecar:
        args.append("-sidecar")
    with open(log, "wb") as lf:
        popen = subprocess.Popen(
            args,
            stdout=lf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pinned(cpus, batch=True),  # noqa: PLW1509 - sched_setaffinity only
        )
    proc = Proc(name, popen, log, 0)
    deadline = time.monotonic() + 30
    while not port_file.exists():  # written (atomically) once every port listens
        if popen.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{name} did not start:\n{proc.log_tail()}")
        time.sleep(0.01)
    ports = json.loads(port_file.read_text())
    proc.port = ports["http"][0]
    return proc, list(ports["http"]), int(ports["sidecar"])


def run_load(
    url: str,
    body: bytes,
    conc: int,
    duration: float,
    warmup: float,
    stream: bool,
    cpus: Collection[int] | None,
    timeout: float = 30.0,
) -> subprocess.Popen[str]:
    """Start ``fastengine load`` (its JSON result on stdout when it exits)."""
    fd, path = tempfile.mkstemp(prefix="pd-bench-body-", suffix=".json")
    with os.fdopen(fd, "wb") as f:
        f.write(body)
    args: Sequence[str] = [
        str(binary()),
        "load",
        "-url",
        url,
        "-c",
        str(conc),
        "-d",
        str(duration),
        "-warmup",
        str(warmup),
        "-timeout",
        str(timeout),
        "-body-file",
        path,
        *(["-stream"] if stream else []),
    ]
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=pinned(cpus, batch=True),  # noqa: PLW1509 - sched_setaffinity only
    )
    p.body_path = path  # type: ignore[attr-defined]
    return p


def load_result(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(OSError, AttributeError):
            os.unlink(p.body_path)  # type: ignore[attr-defined]
    if p.returncode != 0:
        raise RuntimeError(f"fastengine load failed ({p.returncode}): {err.strip()}")
    return json.loads(out)
