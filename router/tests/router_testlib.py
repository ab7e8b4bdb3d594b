"""Helpers for the router tests (a uniquely named module, so it never collides with another
test folder's conftest when several folders run in one pytest session)."""

from __future__ import annotations

import copy
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pd_router_dev.devstack import DEMO_CONFIG, Proc, Stack, free_port

MODEL = "llama-3.3-70b"

# Tokenizer tests: the simulated engine counts one token per word; the tokenizer trained by
# train_tokenizer, one per letter, so the two disagree about which side of the threshold a
# prompt is on.
TOKENIZER_THRESHOLD = 256
TOKENIZER_WORD = "qwertyuiop"
TOKENIZER_ALLOWANCE = 4  # template allowance for /v1/completions (tokens.template_allowance)


def base_config() -> dict[str, Any]:
    """The demo's config, the weights probe off unless a test turns it on: a router that
    re-admits an engine after one slow health check probes it with a real completion, which a
    test counting an engine's requests or faults (engines are shared between routers) would see."""
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    cfg.setdefault("health", {}).setdefault("weightsCheck", False)
    return cfg


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def write_config(workdir: Path, name: str, over: dict[str, Any]) -> Path:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(deep_merge(base_config(), over)))
    return path


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``pd-router ARGS`` to completion (the timeout only stops a broken test)."""
    return subprocess.run(
        [sys.executable, "-m", "pd_router", *args],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=60,
    )


def http_call(
    url: str,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, Any] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(
            method, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers or {}
        )
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post_raw_headers(port: int, path: str, obj: Any, headers: dict[str, str | bytes]) -> int:
    """POST JSON with header values sent as given (bytes that are not UTF-8 included)."""
    body = json.dumps(obj).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for k, v in {**headers, "Content-Type": "application/json"}.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def post_json(url: str, obj: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, dict]:
    h = {"Content-Type": "application/json", **(headers or {})}
    status, hdrs, data = http_call(url, "POST", json.dumps(obj).encode(), h)
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = data
    return status, parsed, hdrs


def metric_value(base: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of samples of ``name`` whose labels include ``labels``."""
    _, _, data = http_call(base + "/metrics")
    total = 0.0
    for line in data.decode().splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lab = head.partition("{")
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in lab for k, v in labels.items()):
            continue
        total += float(value)
    return total


def wait_until(cond: Callable[[], bool], what: str, deadline_s: float = 60) -> None:
    """Poll a condition (not a timing assertion: the deadline only stops a broken test)."""
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"condition never became true: {what}")
        time.sleep(0.05)


def client(router: Proc, **kw: Any) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=router.url() + "/v1", max_retries=0, timeout=60, **kw)


def chat_with_client_kv(router: Proc, text: str, evil: dict[str, Any], rid: str) -> str:
    """A chat request carrying client-made hand-off fields (top level and in ``vllm_xargs``)
    with request id ``rid``; checks the id is echoed and returns the route taken."""
    raw = client(router).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=3,
        extra_body={
            "kv_transfer_params": evil,
            "vllm_xargs": {"kv_transfer_params": evil, "keep_me": 1},
        },
        extra_headers={"X-Request-Id": rid},
    )
    assert raw.headers["x-request-id"] == rid
    assert raw.parse().choices[0].message.content
    return raw.headers["x-pd-route"]


def set_fault(engine: Proc, mode: str, count: int = -1, host: str = "127.0.0.1") -> None:
    status, _, _ = post_json(engine.url(host) + "/sim/fault", {"mode": mode, "count": count})
    assert status == 200


def long_text(words: int = 400) -> str:
    return " ".join(f"word{i % 50}" for i in range(words))


class LMCacheStack:
    """One prefill (LMCache sender, 2 TP ranks) and two decoders (receivers on 127.0.0.2/3
    sharing the same receiver port numbers, as StatefulSet pods do), plus routers."""

    def __init__(self, stack: Stack, pd_proxy_port: int | None = None, name: str = "lm") -> None:
        """``pd_proxy_port``: where the prefiller PUSHes its notifications (default: a free
        port the routers bind, ``notificationReceiver: router``); ``name``: process name prefix
        (unique per stack: it names their log and port files)."""
        self.stack = stack
        self.notify_port = pd_proxy_port or free_port()
        self.init_ports = [free_port(), free_port()]
        self.alloc_ports = [free_port(), free_port()]
        ip = ",".join(map(str, self.init_ports))
        ap = ",".join(map(str, self.alloc_ports))
        self.prefill = stack.sim(
            f"{name}-prefill",
            "--kv-connector",
            "lmcache",
            "--lmcache-role",
            "sender",
            "--tp",
            "2",
            "--pd-proxy-port",
            str(self.notify_port),
        )
        self.decoders = [
            stack.sim(
                f"{name}-decode{i}",
                "--host",
                host,
                "--kv-connector",
                "lmcache",
                "--lmcache-role",
                "receiver",
                "--tp",
                "2",
                "--pd-peer-init-port",
                ip,
                "--pd-peer-alloc-port",
                ap,
            )
            for i, host in enumerate(("127.0.0.2", "127.0.0.3"))
        ]

    def decoder_urls(self) -> list[str]:
        return [d.url(h) for d, h in zip(self.decoders, ("127.0.0.2", "127.0.0.3"), strict=True)]

    def router(self, name: str, over: dict[str, Any] | None = None) -> Proc:
        cfg = deep_merge(
            {
                "routing": {
                    "connector": "lmcache",
                    "threshold": 256,
                    "decision": "length",
                },  # the hand-off under test, not the decision (test_router_decision.py)
                "pools": {
                    "prefill": {"discovery": "static", "static": [self.prefill.url()]},
                    "decode": {"discovery": "static", "static": self.decoder_urls()},
                },
                "lmcache": {
                    "notifyBindHost": "127.0.0.1",
                    "notifyPort": self.notify_port,
                    "notificationsPerRequest": 2,
                    "decoderInitPorts": self.init_ports,
                    "decoderAllocPorts": self.alloc_ports,
                    "notifyTimeoutSeconds": 3,
                },
            },
            over or {},
        )
        return self.stack.router(name, write_config(self.stack.workdir, name, cfg))


def train_tokenizer(folder: Path) -> Tokenizer:
    """A tiny real BPE tokenizer trained here, saved as ``folder/tokenizer.json``."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=len(TOKENIZER_WORD) + 1, special_tokens=["[UNK]"])
    tok.train_from_iterator([" ".join([TOKENIZER_WORD] * 50)] * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def answer(base: str, chat: bool, prompt: str, stream: bool, **extra: Any) -> tuple[str, int, str]:
    """(text, completion tokens, x-pd-route or "") of one request through the openai client to
    ``base`` (a router or an engine); ``extra`` goes into the body as given."""
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw: dict[str, Any] = {"model": MODEL, "extra_body": extra}
    if stream:
        kw["stream_options"] = {"include_usage": True}
    if chat:
        api: Any = c.chat.completions
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        api = c.completions
        kw["prompt"] = prompt
    if not stream:
        raw = api.with_raw_response.create(**kw)
        r = raw.parse()
        text = r.choices[0].message.content if chat else r.choices[0].text
        return text or "", r.usage.completion_tokens, raw.headers.get("x-pd-route", "")
    with api.with_streaming_response.create(stream=True, **kw) as resp:
        chunks = list(resp.parse())
        route = resp.headers.get("x-pd-route", "")
    parts = [
        (ch.choices[0].delta.content if chat else ch.choices[0].text) or ""
        for ch in chunks
        if ch.choices
    ]
    usage = next(ch.usage for ch in reversed(chunks) if ch.usage is not None)
    return "".join(parts), usage.completion_tokens, route


def greedy_chat(
    base: str, model: str, stream: bool, api_key: str = "unused"
) -> tuple[str, str, dict[str, str]]:
    """(text, the answer's model, headers) of one greedy chat of ``long_text(60)`` through the
    openai client, streamed or not."""
    c = openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=60)
    kw: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": long_text(60)}],
        "max_tokens": 12,
        "temperature": 0,
    }
    if not stream:
        raw = c.chat.completions.with_raw_response.create(**kw)
        r = raw.parse()
        return r.choices[0].message.content or "", r.model, dict(raw.headers)
    with c.chat.completions.with_streaming_response.create(stream=True, **kw) as raw:
        chunks = list(raw.parse())
        headers = dict(raw.headers)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks[0].model, headers
