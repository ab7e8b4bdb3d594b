"""Loopback ``/metrics`` proxy (``pd-router metrics-proxy``), one per engine pod.

vLLM serves ``/metrics`` on its OpenAI API port, and a NetworkPolicy cannot filter HTTP
paths: opening that port to Prometheus opens the whole unauthenticated API. This proxy
listens on a port of its own and answers exactly::

    GET|HEAD /metrics   -> GET <upstream>/metrics (the client's Accept forwarded, nothing
                           else; no query string), 200 with the upstream body and
                           Content-Type; 502 (unreachable, non-200, redirect, over
                           --max-bytes) or 504 (over --timeout-seconds), short text bodies
    other method /metrics -> 405
    GET|HEAD /health    -> 200 "ok" (the proxy itself)
    anything else       -> 404

Nothing but ``/metrics`` ever reaches the upstream, request bodies are never read by a
handler, redirects are never followed, and ``--upstream`` must be a loopback URL
(``127.0.0.1``, ``::1`` or ``localhost``, the latter only ever connected to loopback
addresses): a sidecar for its own pod, not an open proxy.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from pd_router.http_server import AppRunner, serve

log = logging.getLogger("pd_router.metrics_proxy")

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
HEAD_TIMEOUT_SECONDS = 5.0  # a client's first request head, whole (http_server.AppRunner)
IDLE_TIMEOUT_SECONDS = 60.0  # keep-alive between scrapes (Prometheus reuses connections)
LINGER_SECONDS = 1.0  # an unread request body is discarded this long, then the socket closes
UPSTREAM_CONNECTIONS = 4  # concurrent upstream fetches (each buffers up to --max-bytes)
DEFAULT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ProxyOptions:
    upstream: URL
    host: str = "0.0.0.0"
    port: int = 8001
    timeout_seconds: float = 5.0
    max_bytes: int = 16 * 1024 * 1024


def parse_upstream(value: str) -> URL:
    """``http://<loopback host>[:port]`` as the URL of its ``/metrics``, else ValueError with
    a message naming ``--upstream``."""
    hint = "a loopback URL such as http://127.0.0.1:8000 (host 127.0.0.1, ::1 or localhost)"
    try:
        url = URL(value)
        host = url.host
        url.port  # noqa: B018 - an invalid port raises here
    except (ValueError, TypeError):
        raise ValueError(f"--upstream: must be {hint}, got {value!r}") from None
    if url.user is not None or url.password is not None:
        raise ValueError(f"--upstream: must be {hint}, without credentials")
    if url.scheme != "http" or not url.absolute:
        raise ValueError(f"--upstream: must be {hint}, got {value!r}")
    if host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"--upstream: must be {hint}: the proxy serves its own pod's engine only, "
            f"got host {host!r}"
        )
    if url.path not in ("", "/") or url.query_string or url.fragment:
        raise ValueError(
            f"--upstream: must be {hint} with no path or query (the proxy always fetches "
            f"/metrics), got {value!r}"
        )
    return url.with_path("/metrics")


class _LoopbackResolver(ThreadedResolver):
    """``localhost`` resolved as usual, but only to loopback addresses."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await super().resolve(host, port, family)
        loopback = [r for r in found if ipaddress.ip_address(r["host"]).is_loopback]
        if not loopback:
            raise OSError(f"{host} resolves to no loopback address")
        return loopback


class _TooLarge(Exception):
    pass


class _BadStatus(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _text(status: int, text: str, **headers: str) -> web.Response:
    return web.Response(status=status, text=text + "\n", headers=headers)


class MetricsProxy:
    def __init__(self, opts: ProxyOptions) -> None:
        self.opts = opts
        self.target = opts.upstream
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=UPSTREAM_CONNECTIONS, resolver=_LoopbackResolver()
            ),
            timeout=aiohttp.ClientTimeout(total=self.opts.timeout_seconds),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,  # never an HTTP(S)_PROXY from the environment
            auto_decompress=True,  # --max-bytes bounds the decompressed body
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _fetch(self, accept: str | None) -> tuple[bytes, str]:
        assert self._session is not None
        headers = {"Accept": accept} if accept is not None else {}
        async with self._session.get(self.target, headers=headers, allow_redirects=False) as r:
            if r.status != 200:
                raise _BadStatus(r.status)
            body = bytearray()
            async for chunk in r.content.iter_any():
                body += chunk
                if len(body) > self.opts.max_bytes:
                    raise _TooLarge
            return bytes(body), r.headers.get("Content-Type") or DEFAULT_CONTENT_TYPE

    async def metrics(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return _text(405, "method not allowed", Allow="GET, HEAD")
        start = time.monotonic()
        try:
            body, ctype = await self._fetch(request.headers.get("Accept"))
        except TimeoutError:  # aiohttp's timeouts subclass it (and are ClientErrors too)
            return self._failed(504, "upstream timed out", start)
        except _TooLarge:
            return self._failed(502, f"upstream answer over {self.opts.max_bytes} bytes", start)
        except _BadStatus as exc:
            return self._failed(502, f"upstream answered {exc.status}", start, exc.status)
        except (aiohttp.ClientConnectionError, OSError) as exc:
            return self._failed(502, "upstream unreachable", start, error=type(exc).__name__)
        except aiohttp.ClientError as exc:  # e.g. a malformed or cut-short answer
            return self._failed(502, "upstream fetch failed", start, error=type(exc).__name__)
        resp = web.Response(body=body, headers={"Content-Type": ctype})
        resp.enable_compression()  # only if the client accepts it (Prometheus: gzip)
        return resp

    def _failed(
        self,
        status: int,
        reason: str,
        start: float,
        upstream_status: int | None = None,
        error: str | None = None,
    ) -> web.Response:
        extra: dict[str, Any] = {
            "status": status,
            "upstream": str(self.target),
            "elapsed_s": round(time.monotonic() - start, 3),
        }
        if upstream_status is not None:
            extra["upstream_status"] = upstream_status
        if error is not None:
            extra["error"] = error
        log.warning("scrape failed: %s", reason, extra=extra)
        return _text(status, reason)

    async def health(self, request: web.Request) -> web.Response:
        return _text(200, "ok")

    async def not_found(self, request: web.Request) -> web.Response:
        return _text(404, "not found")


def build_proxy_app(proxy: MetricsProxy) -> web.Application:
    app = web.Application(client_max_size=1024)  # no handler reads a body; belt and braces
    app.router.add_route("*", "/metrics", proxy.metrics)
    app.router.add_get("/health", proxy.health)
    app.router.add_route("*", "/{tail:.*}", proxy.not_found)

    async def on_startup(_: web.Application) -> None:
        await proxy.start()

    async def on_cleanup(_: web.Application) -> None:
        await proxy.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def run_metrics_proxy(opts: ProxyOptions, port_file: str | None = None) -> None:
    proxy = MetricsProxy(opts)
    app = build_proxy_app(proxy)
    runner = AppRunner(
        app,
        idle_timeout=IDLE_TIMEOUT_SECONDS,
        head_timeout=HEAD_TIMEOUT_SECONDS,
        lingering_time=LINGER_SECONDS,
        handler_cancellation=True,
        access_log=None,
    )

    def announce(port: int) -> None:
        log.warning(
            "metrics-proxy listening on %s:%d for %s (timeout %gs, max %d bytes)",
            opts.host,
            port,
            proxy.target,
            opts.timeout_seconds,
            opts.max_bytes,
        )

    await serve(runner, opts.host, opts.port, 128, port_file, announce)
