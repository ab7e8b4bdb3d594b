"""Several router processes on one port (``listen.workers``), so a pod uses the cores it has.

The supervisor (the process ``pd-router serve`` started) reserves the port with a bound,
non-listening SO_REUSEPORT socket (so ``listen.port: 0`` resolves once), then forks the
workers before any event loop or thread exists. Each worker is a whole router: its own event
loop, endpoint pools with their health checks, balancing state and admission share
(``limits.maxInFlight`` and ``maxQueued`` divided among the workers, rounded up): like router
replicas, only smaller. The kernel spreads new connections over the workers' listening sockets.

Shared on purpose, and only this: the port, and the metrics (prometheus-client's multiprocess
mode in a private directory; any worker answers a scrape with every worker's numbers). The
LMCache notification socket cannot be shared: ``notificationReceiver: router`` runs one worker
(config refuses more), ``prefillSidecar`` keeps no per-request state in the router and scales.

Lifecycle: the port file and the "listening" line are written once every worker listens.
SIGTERM/SIGINT go to every worker, which drains as a single router does; the supervisor exits
when all have. A worker that dies on its own takes the pod down (the others are stopped and
the supervisor exits 1): Kubernetes restarts the container and the crash is visible, instead of
a supervisor hiding a crash loop behind respawns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pd_router.config import RouterConfig, router_binds_notifications

log = logging.getLogger("pd_router")

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cpu_limit() -> int:
    """CPUs this container may use: its cgroup CPU quota (rounded up), else the CPUs it may
    run on."""
    usable = len(os.sched_getaffinity(0))
    quota = period = 0.0
    try:
        q, p = CGROUP_V2_CPU_MAX.read_text().split()
        if q != "max":
            quota, period = float(q), float(p)
    except (OSError, ValueError):
        try:
            quota = float(CGROUP_V1_QUOTA.read_text())
            period = float(CGROUP_V1_PERIOD.read_text())
        except (OSError, ValueError):
            pass
    if quota > 0 and period > 0:
        return max(1, min(usable, math.ceil(quota / period)))
    return max(1, usable)


def worker_count(cfg: RouterConfig) -> int:
    n = cfg.listen.workers
    if n:
        return n
    if router_binds_notifications(cfg):
        log.warning(
            "listen.workers 0 (auto): one worker, as lmcache.notificationReceiver router binds "
            "the notification socket in one process"
        )
        return 1
    return cpu_limit()


def share(cfg: RouterConfig, n: int) -> RouterConfig:
    """The config of one of ``n`` workers: its share of the admission limits."""
    li = cfg.limits
    limits = dataclasses.replace(
        li, max_in_flight=-(-li.max_in_flight // n), max_queued=-(-li.max_queued // n)
    )
    return dataclasses.replace(cfg, limits=limits)


def _reserve(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


RunWorker = Callable[[RouterConfig, int, Callable[[int], None]], None]


def supervise(
    cfg: RouterConfig,
    n: int,
    port_file: str | None,
    run_worker: RunWorker,
    announce: Callable[[int], None],
) -> int:
    """Run ``n`` workers (``run_worker(cfg, port, ready)`` in each forked child) until
    SIGTERM/SIGINT or a worker's death. The exit status of the pod's router."""
    from pd_router.serving import write_port_file

    reserved = _reserve(cfg.listen.host, cfg.listen.port)
    port = reserved.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="pd-router-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any worker imports it
    worker_cfg = share(cfg, n)
    ready_r, ready_w = os.pipe()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    pids: dict[int, int] = {}  # pidfd -> pid
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:  # the worker
                code = 1
                try:
                    _die_with_parent()
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGTERM, signal.SIGINT):
                        signal.signal(sig, signal.SIG_DFL)
                    os.close(ready_r)
                    os.close(wake_r)
                    reserved.close()

                    def ready(_port: int) -> None:
                        os.write(ready_w, b"1")

                    run_worker(worker_cfg, port, ready)
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException as exc:  # reported by the supervisor as a worker's death
                    print(f"pd-router worker {os.getpid()}: {exc}", file=sys.stderr, flush=True)
                finally:
                    os._exit(code)
            pids[os.pidfd_open(pid)] = pid
        os.close(ready_w)
        return _watch(
            pids,
            ready_r,
            wake_r,
            n,
            lambda: stopping,
            lambda: (write_port_file(port_file, port), announce(port)),
        )
    finally:
        signal.set_wakeup_fd(-1)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _watch(
    pids: dict[int, int],
    ready_r: int,
    wake_r: int,
    n: int,
    stopping: Callable[[], bool],
    on_all_ready: Callable[[], None],
) -> int:
    ready = 0
    status = 0
    signalled = False
    while pids:
        if stopping() and not signalled:
            signalled = True
            _signal_all(pids, signal.SIGTERM)
        fds = [*pids, wake_r] + ([ready_r] if ready < n else [])
        readable, _, _ = select.select(fds, [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        if ready_r in readable:
            got = os.read(ready_r, n)
            if not got:  # every worker closed its end: the rest died before listening
                ready = n
            else:
                ready += len(got)
                if ready == n:
                    on_all_ready()
        for fd in [f for f in readable if f in pids]:
            pid = pids.pop(fd)
            os.close(fd)
            _, code = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(code)
            if not signalled:  # died on its own: stop the pod
                log.error("pd-router worker %d exited with %d: stopping the others", pid, code)
                status = code if code > 0 else 1
                signalled = True
                _signal_all(pids, signal.SIGTERM)
            elif code not in (0, -signal.SIGTERM):
                status = status or 1
    return status


def _die_with_parent() -> None:
    """SIGTERM this worker if the supervisor dies (even by SIGKILL): no orphaned workers."""
    import ctypes

    pr_set_pdeathsig = 1  # linux/prctl.h
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _signal_all(pids: dict[int, int], sig: int) -> None:
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
