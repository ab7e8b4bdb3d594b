"""``pd-router`` command line: ``serve``, ``check-config``, ``notify-sidecar`` and
``metrics-proxy``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from collections.abc import Callable

from pd_router import __version__
from pd_router.config import (
    NOTIFY_PORT,
    SIDECAR_PORT,
    ConfigError,
    RouterConfig,
    load_config,
    to_dict,
)
from pd_router.connectors import CONNECTORS


def _load(path: str) -> RouterConfig:
    return load_config(path, os.environ)


async def run_server(
    cfg: RouterConfig,
    port_file: str | None = None,
    *,
    port: int | None = None,
    reuse_port: bool = False,
    announce: Callable[[int], None] | None = None,
) -> None:
    """Serve until SIGTERM: the whole router in one process, or one of several workers
    (``port``/``reuse_port`` given by pd_router.workers, ``announce`` its ready signal)."""
    from pd_router import http1
    from pd_router.app import Router, build_server

    router = Router(cfg)
    server = build_server(router)
    # Request bodies are taken as sent, like vLLM's server does: the router refuses a
    # Content-Encoding itself (415).
    await http1.serve(
        server,
        cfg.listen.host,
        cfg.listen.port if port is None else port,
        4096,
        port_file,
        announce or _announcer(cfg, 1),
        router.start,
        router.stop,
        reuse_port=reuse_port,
    )


def _announcer(cfg: RouterConfig, workers: int) -> Callable[[int], None]:
    def announce(port: int) -> None:
        logging.getLogger("pd_router").warning(
            "pd-router %s listening on %s:%d (connector=%s threshold=%d notifications=%s "
            "workers=%d)",
            __version__,
            cfg.listen.host,
            port,
            cfg.routing.connector,
            cfg.routing.threshold,
            cfg.lmcache.notification_receiver
            if CONNECTORS[cfg.routing.connector].notifications
            else "-",
            workers,
        )

    return announce


def _run_worker(cfg: RouterConfig, port: int, ready: Callable[[int], None]) -> None:
    try:
        asyncio.run(run_server(cfg, port=port, reuse_port=True, announce=ready))
    except ConfigError as exc:
        print(f"pd-router: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as exc:
        print(f"pd-router: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _fast_loop() -> None:
    if os.environ.get("PD_ROUTER_EVENT_LOOP", "uvloop") == "uvloop":  # "asyncio": measurements
        import uvloop

        uvloop.install()


def _sidecar_main(a: argparse.Namespace) -> int:
    from pd_router import logs
    from pd_router.handoff.lmcache_sidecar import SidecarOptions, run_sidecar

    errors = []
    if not 0 <= a.port <= 65535:
        errors.append(f"--port: must be between 0 and 65535, got {a.port}")
    if not (a.ttl_seconds > 0 and a.ttl_seconds < float("inf")):
        errors.append(f"--ttl-seconds: must be > 0, got {a.ttl_seconds}")
    if a.max_pending < 1:
        errors.append(f"--max-pending: must be >= 1, got {a.max_pending}")
    if errors:
        print("pd-router notify-sidecar: " + "; ".join(errors), file=sys.stderr)
        return 2
    logs.setup(a.log_level)
    _fast_loop()
    opts = SidecarOptions(a.host, a.port, a.zmq_bind, a.ttl_seconds, a.max_pending)
    try:
        asyncio.run(run_sidecar(opts, a.port_file))
    except OSError as exc:
        print(f"pd-router notify-sidecar: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _metrics_proxy_main(a: argparse.Namespace) -> int:
    import math

    from pd_router import logs
    from pd_router.metrics_proxy import ProxyOptions, parse_upstream, run_metrics_proxy

    errors = []
    if not 0 <= a.port <= 65535:
        errors.append(f"--port: must be between 0 and 65535, got {a.port}")
    try:
        upstream = parse_upstream(a.upstream)
    except ValueError as exc:
        errors.append(str(exc))
    if not (math.isfinite(a.timeout_seconds) and 0 < a.timeout_seconds <= 600):
        errors.append(f"--timeout-seconds: must be > 0 and <= 600, got {a.timeout_seconds}")
    if a.max_bytes < 1:
        errors.append(f"--max-bytes: must be >= 1, got {a.max_bytes}")
    if errors:
        print("pd-router metrics-proxy: " + "; ".join(errors), file=sys.stderr)
        return 2
    logs.setup(a.log_level)
    _fast_loop()
    opts = ProxyOptions(upstream, a.host, a.port, a.timeout_seconds, a.max_bytes)
    try:
        asyncio.run(run_metrics_proxy(opts, a.port_file))
    except OSError as exc:
        print(f"pd-router metrics-proxy: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    """``pd-router`` and its subcommands: the router, and the two sidecars of an engine pod."""
    p = argparse.ArgumentParser(prog="pd-router", description="Prefill/decode router for vLLM")
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the router")
    s.add_argument("--config", required=True, help="YAML config file (the chart's ConfigMap)")
    s.add_argument("--port-file", help="write the bound port here once listening (tests)")
    c = sub.add_parser("check-config", help="validate a config file and print the result")
    c.add_argument("--config", required=True)
    n = sub.add_parser(
        "notify-sidecar",
        help="receive LMCache notifications next to a prefiller (lmcache.notificationReceiver: "
        "prefillSidecar)",
    )
    n.add_argument("--host", default="0.0.0.0", help="HTTP bind address")
    n.add_argument(
        "--port", type=int, default=SIDECAR_PORT, help="HTTP port (= lmcache.sidecarPort)"
    )
    n.add_argument(
        "--zmq-bind",
        default=f"tcp://127.0.0.1:{NOTIFY_PORT}",
        help="ZMQ PULL endpoint the prefiller's LMCache PUSHes ProxyNotif to "
        "(pd_proxy_host 127.0.0.1, pd_proxy_port = this port)",
    )
    n.add_argument("--ttl-seconds", type=float, default=120.0, help="keep unclaimed ids this long")
    n.add_argument("--max-pending", type=int, default=100000, help="most ids held at once")
    n.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    n.add_argument("--port-file", help="write the bound port here once listening (tests)")
    m = sub.add_parser(
        "metrics-proxy",
        help="serve only the engine's /metrics on a port of its own (a sidecar in each engine "
        "pod, so Prometheus never reaches the OpenAI API)",
    )
    m.add_argument("--host", default="0.0.0.0", help="HTTP bind address")
    m.add_argument("--port", type=int, default=8001, help="HTTP port Prometheus scrapes")
    m.add_argument(
        "--upstream",
        required=True,
        help="the engine in this pod, e.g. http://127.0.0.1:8000: a loopback URL (127.0.0.1, "
        "::1 or localhost) whose /metrics is fetched",
    )
    m.add_argument(
        "--timeout-seconds", type=float, default=5.0, help="bound on one upstream fetch, whole"
    )
    m.add_argument(
        "--max-bytes", type=int, default=16 * 1024 * 1024, help="largest /metrics body passed"
    )
    m.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m.add_argument("--port-file", help="write the bound port here once listening (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "notify-sidecar":
        return _sidecar_main(a)
    if a.cmd == "metrics-proxy":
        return _metrics_proxy_main(a)
    try:
        cfg = _load(a.config)
    except ConfigError as exc:
        print(f"pd-router: invalid config: {exc}", file=sys.stderr)
        return 2
    if a.cmd == "check-config":
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from pd_router import logs

    logs.setup(cfg.logging.level)
    _fast_loop()
    # Fewer young-generation collections: requests allocate many short-lived objects and
    # keep almost none (measured: ~7 % less CPU per request; docs/benchmarks.md "HTTP stack").
    gc.freeze()
    gc.set_threshold(20000, 50, 100)
    from pd_router.workers import supervise, worker_count

    workers = worker_count(cfg)
    if workers > 1:
        try:
            return supervise(cfg, workers, a.port_file, _run_worker, _announcer(cfg, workers))
        except OSError as exc:
            print(f"pd-router: cannot start: {exc}", file=sys.stderr)
            return 1
    try:
        asyncio.run(run_server(cfg, a.port_file))
    except ConfigError as exc:
        print(f"pd-router: invalid config: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pd-router: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
