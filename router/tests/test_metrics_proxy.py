"""``pd-router metrics-proxy``: only the engine's /metrics, on a port of its own (real
processes on loopback: a simulated engine, and a scripted upstream in this process)."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pd_router import cli
from pd_router.metrics_proxy import _LoopbackResolver, parse_upstream
from pd_router_dev.devstack import Proc, Stack, free_port
from router_testlib import http_call, metric_value, run_cli

FAKE_TIMEOUT = "2"  # the scripted upstream's proxy: bounds the stall tests only
FAKE_MAX_BYTES = 32768
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
SECRET = "SECRET-UPSTREAM-BODY-do-not-log"

# (method, path, body, expected status) through the proxy: none may reach the upstream
REFUSED: list[tuple[str, str, bytes | None, int]] = [
    ("GET", "/v1/models", None, 404),
    ("POST", "/v1/completions", b'{"model":"m","prompt":"hi","max_tokens":4}', 404),
    ("POST", "/v1/chat/completions", b'{"model":"m","messages":[]}', 404),
    ("POST", "/tokenize", b'{"model":"m","prompt":"hi"}', 404),
    ("GET", "/sim/requests", None, 404),
    ("POST", "/sim/fault", b'{"mode":"error"}', 404),
    ("GET", "/metrics/", None, 404),
    ("GET", "/v1/../metrics/x", None, 404),
    ("GET", "/", None, 404),
    ("POST", "/health", b"x", 404),
    ("POST", "/metrics", b"x" * 100_000, 405),
    ("PUT", "/metrics", b"x", 405),
    ("DELETE", "/metrics", None, 405),
    ("OPTIONS", "/metrics", None, 405),
]


class FakeUpstream:
    """A scripted engine: records every request, answers /metrics per ``behaviour``."""

    OK_BODY = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"

    def __init__(self) -> None:
        self.behaviour = "ok"
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                with fake.lock:
                    fake.requests.append(
                        {"method": self.command, "path": self.path, "headers": dict(self.headers)}
                    )
                fake.answer(self)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        b = self.behaviour
        if b == "ok":
            om = "application/openmetrics-text" in h.headers.get("Accept", "")
            body = self.OK_BODY + (b"# EOF\n" if om else b"")
            self._send(h, 200, body, OPENMETRICS if om else PROMETHEUS_TEXT)
        elif b == "error":
            self._send(h, 500, SECRET.encode(), "text/plain")
        elif b == "redirect":
            h.send_response(302)
            h.send_header("Location", "/v1/models")
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif b == "big":  # chunked: no Content-Length to refuse it by
            h.send_response(200)
            h.send_header("Content-Type", PROMETHEUS_TEXT)
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            chunk = b"#" * 4096
            for _ in range(FAKE_MAX_BYTES // len(chunk) + 2):
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            h.wfile.write(b"0\r\n\r\n")
        elif b == "stall_head":
            self.release.wait(120)
        elif b == "cut":  # fewer bytes than Content-Length, then the connection closes
            h.send_response(200)
            h.send_header("Content-Type", PROMETHEUS_TEXT)
            h.send_header("Content-Length", "100000")
            h.end_headers()
            h.wfile.write(b"# partial\n")
        elif b == "stall_body":
            h.send_response(200)
            h.send_header("Content-Type", PROMETHEUS_TEXT)
            h.send_header("Content-Length", "100000")
            h.end_headers()
            h.wfile.write(b"# partial\n")
            h.wfile.flush()
            self.release.wait(120)
        h.close_connection = b != "ok"

    @staticmethod
    def _send(h: http.server.BaseHTTPRequestHandler, status: int, body: bytes, ct: str) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ct)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def reset(self, behaviour: str = "ok") -> None:
        with self.lock:
            self.requests.clear()
        self.behaviour = behaviour

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def sim(stack: Stack) -> Proc:
    return stack.sim("mp-engine")


@pytest.fixture(scope="module")
def proxy(stack: Stack, sim: Proc) -> Proc:
    return stack.metrics_proxy("mp-proxy", sim.port)


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[FakeUpstream]:
    f = FakeUpstream()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def fake(fake_upstream: FakeUpstream) -> FakeUpstream:
    fake_upstream.reset()
    return fake_upstream


@pytest.fixture(scope="module")
def fake_proxy(stack: Stack, fake_upstream: FakeUpstream) -> Proc:
    return stack.metrics_proxy(
        "mp-fake-proxy",
        fake_upstream.port,
        "--timeout-seconds",
        FAKE_TIMEOUT,
        "--max-bytes",
        str(FAKE_MAX_BYTES),
    )


def _families(text: bytes, prefix: str = "vllm:") -> set[str]:
    return {
        line.split()[2]
        for line in text.decode().splitlines()
        if line.startswith("# TYPE ") and line.split()[2].startswith(prefix)
    }


def _samples(text: bytes, prefix: str = "vllm:") -> set[str]:
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.decode().splitlines()
        if line.startswith(prefix)
    }


def _engine_activity(sim: Proc) -> tuple[Any, float, float]:
    return (
        json.loads(http_call(sim.url() + "/sim/requests")[2]),
        metric_value(sim.url(), "vllm:request_success_total"),
        metric_value(sim.url(), "vllm:prompt_tokens_total"),
    )


# ------------------------------------------------------------------ against the simulated engine


@pytest.mark.parametrize("path", ["/metrics", "/metrics?x=1"])
def test_metrics_through_proxy_match_engine(sim: Proc, proxy: Proc, path: str) -> None:
    status, headers, body = http_call(proxy.url() + path)
    assert status == 200
    _, direct_headers, direct = http_call(sim.url() + "/metrics")
    assert headers["content-type"] == direct_headers["content-type"]
    assert "vllm:num_requests_running" in _families(body)
    assert _families(body) == _families(direct)
    assert _samples(body) == _samples(direct)


def test_head_metrics(proxy: Proc) -> None:
    status, headers, body = http_call(proxy.url() + "/metrics", method="HEAD")
    assert status == 200
    assert body == b""
    assert headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) > 0


@pytest.mark.parametrize(("method", "path", "body", "expected"), REFUSED)
def test_api_refused_engine_untouched(
    sim: Proc, proxy: Proc, method: str, path: str, body: bytes | None, expected: int
) -> None:
    http_call(sim.url() + "/sim/requests?clear=1")
    before = _engine_activity(sim)
    headers = {"Content-Type": "application/json"} if body else {}
    status, got_headers, got = http_call(proxy.url() + path, method, body, headers)
    assert status == expected
    if expected == 405:
        assert got_headers["allow"] == "GET, HEAD"
    assert b"vllm" not in got and b"model" not in got
    assert before[0] == []
    assert _engine_activity(sim) == before


def test_health_is_the_proxys_own(proxy: Proc) -> None:
    assert http_call(proxy.url() + "/health")[::2] == (200, b"ok\n")


def test_sigterm_exits_cleanly(stack: Stack, sim: Proc) -> None:
    p = stack.metrics_proxy("mp-term", sim.port)
    assert http_call(p.url() + "/metrics")[0] == 200
    p.popen.send_signal(signal.SIGTERM)
    assert p.popen.wait(30) == 0


# ------------------------------------------------------------------ against a scripted upstream


def test_nothing_but_metrics_reaches_upstream(fake: FakeUpstream, fake_proxy: Proc) -> None:
    for method, path, body, expected in REFUSED:
        assert http_call(fake_proxy.url() + path, method, body)[0] == expected, (method, path)
    assert http_call(fake_proxy.url() + "/health")[0] == 200
    assert fake.requests == []


def test_only_accept_forwarded_and_no_query(fake: FakeUpstream, fake_proxy: Proc) -> None:
    status, headers, body = http_call(
        fake_proxy.url() + "/metrics?name[]=x&debug=1",
        headers={
            "Accept": "application/openmetrics-text; version=1.0.0,text/plain;q=0.5",
            "Authorization": "Bearer client-key",
            "Cookie": "a=b",
            "X-Forwarded-For": "10.9.9.9",
        },
    )
    assert status == 200
    assert headers["content-type"] == OPENMETRICS
    assert body == FakeUpstream.OK_BODY + b"# EOF\n"
    [req] = fake.requests
    assert (req["method"], req["path"]) == ("GET", "/metrics")
    sent = {k.lower(): v for k, v in req["headers"].items()}
    assert sent["accept"] == "application/openmetrics-text; version=1.0.0,text/plain;q=0.5"
    assert not {"authorization", "cookie", "x-forwarded-for"} & set(sent)

    status, headers, body = http_call(fake_proxy.url() + "/metrics")
    assert (status, headers["content-type"], body) == (200, PROMETHEUS_TEXT, FakeUpstream.OK_BODY)


def test_gzip_for_clients_that_accept_it(fake: FakeUpstream, fake_proxy: Proc) -> None:
    status, headers, body = http_call(
        fake_proxy.url() + "/metrics", headers={"Accept-Encoding": "gzip"}
    )
    assert status == 200
    assert headers["content-encoding"] == "gzip"
    assert gzip.decompress(body) == FakeUpstream.OK_BODY


def _log_since(p: Proc, offset: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in p.log.read_text()[offset:].splitlines() if line]


@pytest.mark.parametrize(
    ("behaviour", "status", "reason"),
    [
        ("error", 502, "upstream answered 500"),
        ("redirect", 502, "upstream answered 302"),
        ("big", 502, f"upstream answer over {FAKE_MAX_BYTES} bytes"),
        ("cut", 502, "upstream fetch failed"),
        ("stall_head", 504, "upstream timed out"),
        ("stall_body", 504, "upstream timed out"),
    ],
)
def test_upstream_failures(
    fake: FakeUpstream, fake_proxy: Proc, behaviour: str, status: int, reason: str
) -> None:
    fake.reset(behaviour)
    offset = len(fake_proxy.log.read_text())
    got_status, headers, body = http_call(fake_proxy.url() + "/metrics")
    assert (got_status, body) == (status, reason.encode() + b"\n")
    assert headers["content-type"].startswith("text/plain")
    assert len(fake.requests) == 1  # a redirect is not followed
    lines = _log_since(fake_proxy, offset)
    assert [(r["level"], r["msg"], r["status"]) for r in lines] == [
        ("warning", f"scrape failed: {reason}", status)
    ]
    assert SECRET not in fake_proxy.log.read_text()
    fake.reset()
    assert http_call(fake_proxy.url() + "/metrics")[0] == 200  # and it recovers


def test_upstream_down_gives_502_not_a_timeout(stack: Stack) -> None:
    # a 60 s timeout: a 502 (not 504) shows the refused connection was not waited out
    p = stack.metrics_proxy("mp-down", free_port(), "--timeout-seconds", "60")
    status, _, body = http_call(p.url() + "/metrics")
    assert (status, body) == (502, b"upstream unreachable\n")
    [line] = [r for r in _log_since(p, 0) if r["msg"].startswith("scrape failed")]
    assert line["level"] == "warning" and line["error"]


# ------------------------------------------------------------------ start-up


@pytest.mark.parametrize(
    "upstream",
    [
        "http://10.0.0.1:8000",
        "http://example.com:8000",
        "http://0.0.0.0:8000",
        "http://127.0.0.2:8000",
        "http://[::ffff:10.0.0.1]:8000",
        "https://127.0.0.1:8000",
        "127.0.0.1:8000",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000/?x=1",
        "http://127.0.0.1:99999",
        "http://user:hunter2@127.0.0.1:8000",
        "",
    ],
)
def test_non_loopback_upstream_refused(upstream: str, capsys: pytest.CaptureFixture[str]) -> None:
    # in process (main() refuses before it binds or sets up logging); the real CLI below
    rc = cli.main(["metrics-proxy", "--host", "127.0.0.1", "--port", "0", "--upstream", upstream])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("pd-router metrics-proxy: --upstream: ")
    assert "hunter2" not in err


def test_non_loopback_upstream_refused_by_the_cli() -> None:
    r = run_cli("metrics-proxy", "--port", "0", "--upstream", "http://10.0.0.1:8000")
    assert r.returncode == 2
    assert "--upstream" in r.stderr and "loopback" in r.stderr
    assert "listening" not in r.stdout


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--timeout-seconds", "0"), ("--timeout-seconds", "nan"), ("--max-bytes", "0")],
)
def test_bad_limits_refused(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["metrics-proxy", "--upstream", "http://127.0.0.1:1", flag, value]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("upstream", "target"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
        ("http://[::1]:8000/", "http://[::1]:8000/metrics"),
        ("http://LOCALHOST:8000", "http://localhost:8000/metrics"),
    ],
)
def test_loopback_upstream_accepted(upstream: str, target: str) -> None:
    assert str(parse_upstream(upstream)) == target


def test_localhost_resolves_to_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiohttp.resolver import ThreadedResolver

    def fake_resolve(addrs: list[str]) -> Any:
        async def resolve(self: Any, host: str, port: int = 0, family: Any = 0) -> Any:
            return [
                {"hostname": host, "host": a, "port": port, "family": 0, "proto": 0, "flags": 0}
                for a in addrs
            ]

        return resolve

    async def run(addrs: list[str]) -> list[str]:
        monkeypatch.setattr(ThreadedResolver, "resolve", fake_resolve(addrs))
        return [r["host"] for r in await _LoopbackResolver().resolve("localhost", 80)]

    assert asyncio.run(run(["10.1.2.3", "127.0.0.1", "::1"])) == ["127.0.0.1", "::1"]
    with pytest.raises(OSError):
        asyncio.run(run(["10.1.2.3"]))


def test_bind_failure_is_reported(sim: Proc) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli(
            "metrics-proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--upstream",
            f"http://127.0.0.1:{sim.port}",
        )
    assert r.returncode == 1
    assert "cannot start" in r.stderr
