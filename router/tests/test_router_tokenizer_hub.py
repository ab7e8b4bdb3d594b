"""``model.tokenizerHub``: the router fetches ``tokenizer.json`` once at start-up from a
Hugging Face-compatible hub (here a real HTTP server on loopback that answers like one:
``/{repo}/resolve/{revision}/tokenizer.json``, Bearer tokens, a redirect to a CDN path).

Refusals (401/404/not a tokenizer) stop start-up naming the field; an unreachable or hanging
hub does not: the router starts and counts with the engines' ``/tokenize``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pd_router.config import ConfigError, TokenizerHub, parse_config
from pd_router.hub_tokenizer import tokenizer_url
from pd_router_dev.devstack import Proc, Stack
from router_testlib import (
    TOKENIZER_ALLOWANCE as ALLOWANCE,
)
from router_testlib import (
    TOKENIZER_THRESHOLD as THRESHOLD,
)
from router_testlib import (
    TOKENIZER_WORD as WORD,
)
from router_testlib import (
    metric_value,
    post_json,
    run_cli,
    train_tokenizer,
    write_config,
)

TOKEN = "hf_test_token"


class FakeHub:
    """Serves one tokenizer.json under several repos, each with its own behaviour."""

    def __init__(self, tokenizer_json: bytes) -> None:
        self.tokenizer_json = tokenizer_json
        self.paths: list[str] = []
        self.auth: dict[str, str | None] = {}
        self.flaky_left = 1
        self.release = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def _send(self, status: int, body: bytes = b"", location: str = "") -> None:
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                hub.paths.append(self.path)
                hub.auth[self.path] = self.headers.get("Authorization")
                if self.path in ("/cdn/tokenizer.json", "/other-origin/tokenizer.json"):
                    self._send(200, hub.tokenizer_json)
                    return
                repo = self.path.split("/resolve/")[0].lstrip("/")
                if repo == "org/model":
                    self._send(302, location="/cdn/tokenizer.json")  # like an LFS/Xet file
                elif repo == "org/cdn":  # another origin (host name differs), like a real CDN
                    port = self.server.server_address[1]
                    self._send(302, location=f"http://localhost:{port}/other-origin/tokenizer.json")
                elif repo == "org/gated":
                    ok = self.headers.get("Authorization") == f"Bearer {TOKEN}"
                    self._send(200, hub.tokenizer_json) if ok else self._send(401)
                elif repo == "org/flaky" and hub.flaky_left > 0:
                    hub.flaky_left -= 1
                    self._send(503)
                elif repo == "org/flaky":
                    self._send(200, hub.tokenizer_json)
                elif repo == "org/down":
                    self._send(503)
                elif repo == "org/hang":
                    hub.release.wait(60)  # answers only when the test ends
                    self._send(503)
                elif repo == "org/garbage":
                    self._send(200, b'{"not": "a tokenizer"}')
                else:
                    self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def hits(self, repo: str) -> int:
        return sum(1 for p in self.paths if p.startswith(f"/{repo}/resolve/"))


class Env:
    def __init__(self, stack: Stack, folder: Path) -> None:
        self.stack = stack
        self.folder = folder
        self.tok = train_tokenizer(folder / "model")
        self.hub = FakeHub((folder / "model" / "tokenizer.json").read_bytes())
        self.token_file = folder / "hf-token"
        self.token_file.write_text(TOKEN + "\n")
        self.prefill = stack.sim("hub-prefill", "--kv-connector", "nixl")
        self.decode = stack.sim("hub-decode", "--kv-connector", "nixl")

    def config(self, name: str, **hub: Any) -> Path:
        cfg: dict[str, Any] = {
            "model": {"tokenizerHub": {"endpoint": self.hub.endpoint, **hub}},
            "routing": {"connector": "nixl", "threshold": THRESHOLD},
            "pools": {
                "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                "decode": {"discovery": "static", "static": [self.decode.url()]},
            },
        }
        return write_config(self.folder, name, cfg)

    def router(self, name: str, **hub: Any) -> Proc:
        return self.stack.router(name, self.config(name, **hub))


@pytest.fixture(scope="module")
def env(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    e = Env(stack, tmp_path_factory.mktemp("hub"))
    try:
        yield e
    finally:
        e.hub.close()


def _route(router: Proc, words: int) -> str:
    status, body, hdrs = post_json(
        router.url() + "/v1/completions",
        {"prompt": " ".join([WORD] * words), "max_tokens": 2, "ignore_eos": True},
    )
    assert status == 200, body
    return hdrs["x-pd-route"]


def _counted_by(router: Proc, source: str) -> float:
    return metric_value(router.url(), "pd_router_token_count_total", {"source": source})


def test_fetched_tokenizer_decides_the_route(env: Env) -> None:
    r = env.router("hub-ok", repo="org/model", revision="main")
    assert metric_value(r.url(), "pd_router_tokenizer_loaded", {"source": "hub"}) == 1
    # the redirect to the CDN path was followed; fetched once, at start-up
    assert env.hub.hits("org/model") == 1
    assert "/cdn/tokenizer.json" in env.hub.paths
    before = _counted_by(r, "tokenizer")
    # the simulated engine would count 31 tokens here (direct); our tokenizer about 300
    assert len(env.tok.encode(" ".join([WORD] * 30)).ids) + ALLOWANCE >= THRESHOLD
    assert _route(r, 30) == "disaggregated"
    assert _route(r, 24) == "direct"
    assert _counted_by(r, "tokenizer") == before + 2
    assert _counted_by(r, "engine") == 0
    assert env.hub.hits("org/model") == 1  # requests never go back to the hub


def test_gated_repo_sends_the_token_from_the_file(env: Env) -> None:
    r = env.router("hub-gated", repo="org/gated", revision="v1.0", tokenFile=str(env.token_file))
    assert metric_value(r.url(), "pd_router_tokenizer_loaded", {"source": "hub"}) == 1
    assert env.hub.auth["/org/gated/resolve/v1.0/tokenizer.json"] == f"Bearer {TOKEN}"


def test_the_token_does_not_follow_a_redirect_to_another_origin(env: Env) -> None:
    r = env.router("hub-cdn", repo="org/cdn", tokenFile=str(env.token_file))
    assert metric_value(r.url(), "pd_router_tokenizer_loaded", {"source": "hub"}) == 1
    assert env.hub.auth["/org/cdn/resolve/main/tokenizer.json"] == f"Bearer {TOKEN}"
    assert env.hub.auth["/other-origin/tokenizer.json"] is None


def test_a_transient_hub_error_is_retried(env: Env) -> None:
    r = env.router("hub-flaky", repo="org/flaky", timeoutSeconds=60)
    assert env.hub.hits("org/flaky") == 2  # one 503, then the file
    assert metric_value(r.url(), "pd_router_tokenizer_loaded", {"source": "hub"}) == 1


@pytest.mark.parametrize("repo", ["org/down", "org/hang"])
def test_an_unavailable_hub_does_not_keep_the_router_down(env: Env, repo: str) -> None:
    r = env.router(f"hub-{repo.split('/')[1]}", repo=repo, timeoutSeconds=1)
    assert env.hub.hits(repo) >= 1
    assert metric_value(r.url(), "pd_router_tokenizer_loaded", {"source": "hub"}) == 0
    assert "counting prompt tokens with the engines' /tokenize" in r.log_tail()
    before = _counted_by(r, "engine")
    assert _route(r, 30) == "direct"  # the engine counts 31 tokens
    assert _counted_by(r, "engine") == before + 1


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"repo": "org/missing"}, "model.tokenizerHub.repo: no tokenizer.json in 'org/missing'"),
        ({"repo": "org/gated"}, "model.tokenizerHub.tokenFile: the hub answered 401"),
        ({"repo": "org/garbage"}, "model.tokenizerHub: http://"),
        ({"repo": "org/model", "tokenFile": "/no/such/token"}, "model.tokenizerHub.tokenFile"),
    ],
)
def test_a_refusal_stops_start_up_naming_the_field(
    env: Env, over: dict[str, str], field: str
) -> None:
    out = run_cli("serve", "--config", str(env.config("hub-refused", **over)))
    assert out.returncode == 2, out.stderr
    assert f"pd-router: invalid config: {field}" in out.stderr
    assert "Traceback" not in out.stderr


def test_revision_is_percent_encoded() -> None:
    hub = TokenizerHub(repo="org/m", revision="refs/pr/1", endpoint="https://hub.example/mirror/")
    assert (
        tokenizer_url(hub)
        == "https://hub.example/mirror/org/m/resolve/refs%2Fpr%2F1/tokenizer.json"
    )


@pytest.mark.parametrize(
    ("hub", "message"),
    [
        ({"repo": "org/m", "revision": ""}, "model.tokenizerHub.revision"),
        ({"repo": "../etc/passwd"}, "model.tokenizerHub.repo"),
        ({"repo": "a/b/c"}, "model.tokenizerHub.repo"),
        ({"repo": "org/m", "endpoint": "ftp://x"}, "model.tokenizerHub.endpoint"),
        ({"repo": "org/m", "timeoutSeconds": 0}, "model.tokenizerHub.timeoutSeconds"),
        ({"repo": "org/m", "tokenfile": "x"}, "model.tokenizerHub.tokenfile: unknown field"),
    ],
)
def test_bad_hub_settings_name_the_field(hub: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{message}"):
        parse_config({"model": {"tokenizerHub": hub}})


def test_a_local_file_and_a_hub_repo_are_exclusive() -> None:
    with pytest.raises(ConfigError, match=r"^model\.tokenizerHub\.repo: set either"):
        parse_config({"model": {"tokenizer": "/t.json", "tokenizerHub": {"repo": "org/m"}}})
