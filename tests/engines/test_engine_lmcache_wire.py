"""The router's LMCache hand-off against LMCache's real PD control plane.

A prefiller whose KV goes out through LMCache 0.5.6's own PDBackendAsync senders (2 TP ranks,
NIXL/UCX on CPU buffers) to LMCache receivers bound on the decoder's ports, configured from the
chart's rendered LMCache ConfigMaps (harness/lmcache_prefiller.py). The router picks a decoder,
puts its address and ports into `disagg_spec`, and must get LMCache's ProxyNotif for the request
id it chose, once with `notificationReceiver: router` and once through the notification sidecar.
The decoder is the simulated engine (no GPU to run vLLM on), asked exactly as a direct request.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from pd_router_dev.devstack import DEMO_CONFIG, Proc, Stack, free_port

from tests import helm
from tests.cases import LMCACHE
from tests.engines import stack

# One worker runs the whole module: its real-stack harness runs once, cached (pytest-xdist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-lmcache-wire")

TP = 2
MODEL = "llama-3.1-8b"  # tests/values/lmcache.yaml servedName
BUFFER = 4 << 20
PROMPT = " ".join(f"word{i % 97}" for i in range(700))  # > 2 LMCache chunks of 256 tokens


def rendered_lmcache(sets: tuple[str, ...] = ()) -> dict[str, str]:
    docs = helm.render(
        helm.helm_binaries()[0],
        (LMCACHE,),
        (f"prefill.tensorParallelSize={TP}", f"decode.tensorParallelSize={TP}", *sets),
    )
    return {
        role: helm.one(docs, "ConfigMap", f"-{role}-lmcache")["data"]["lmcache.yaml"] for role in ("prefill", "decode")
    }


@dataclass
class Harness:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> Any:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url() + path, timeout=30) as r:
            return json.loads(r.read())


def start_harness(
    workdir: Path, name: str, rendered: dict[str, str], proxy_port: int, init: list[int], alloc: list[int]
) -> Harness:
    import json
    import time

    port_file, log = workdir / f"{name}.port", workdir / f"{name}.log"
    conf = {
        "tp": TP,
        "model": MODEL,
        "max_model_len": 32768,
        "port_file": str(port_file),
        "sender_yaml": rendered["prefill"],
        "receiver_yaml": rendered["decode"],
        # Only what a CPU machine with free ports needs; every other key as rendered.
        "sender_overrides": {
            "pd_buffer_device": "cpu",
            "pd_buffer_size": BUFFER,
            "pd_proxy_host": "127.0.0.1",
            "pd_proxy_port": proxy_port,
        },
        "receiver_overrides": {
            "pd_buffer_device": "cpu",
            "pd_buffer_size": BUFFER,
            "pd_peer_init_port": init,
            "pd_peer_alloc_port": alloc,
        },
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(stack.python()), str(stack.HARNESS / "lmcache_prefiller.py")],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=stack.env("0.31.0"),
            start_new_session=True,
        )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(conf).encode())
    proc.stdin.close()
    deadline = time.monotonic() + 120  # the deadline stops a broken start; it is not a timing assertion
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)
    return Harness(proc, int(port_file.read_text()), log)


@dataclass
class Setup:
    router: Proc
    decoder: Proc
    harness: Harness


def router_config(workdir: Path, name: str, prefill: str, decoder: str, lmcache: dict[str, Any]) -> Path:
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    cfg["model"]["servedName"] = MODEL
    cfg["routing"].update(connector="lmcache", threshold=64)
    cfg["pools"] = {
        "prefill": {"discovery": "static", "static": [prefill]},
        "decode": {"discovery": "static", "static": [decoder]},
    }
    cfg["lmcache"] = {"notifyBindHost": "127.0.0.1", "notificationsPerRequest": TP, **lmcache}
    # Generous health checks and timeouts: on a loaded 2-core box the LMCache process can be slow
    # to answer, and these tests are about the hand-off, not about ejecting a slow engine.
    cfg["health"].update(intervalSeconds=5, timeoutSeconds=20, unhealthyThreshold=10, passiveFailureThreshold=10)
    # The prefiller is LMCache's senders in a harness, not the model the simulated decoder is:
    # their answers differ, and the weights check (pd_router.weights) would rightly refuse them.
    cfg["health"]["weightsCheck"] = False
    cfg["timeouts"].update(connectSeconds=20, prefillSeconds=300, firstByteSeconds=300, streamIdleSeconds=300)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def lmcache_setup(receiver: str, reachable: bool = True) -> Iterator[Setup]:
    """`receiver`: router | prefillSidecar. `reachable=False`: LMCache PUSHes its notifications
    to a port nobody listens on (a wrong proxy host, a dropped port, a dead sidecar)."""
    with Stack() as st:
        workdir = st.workdir
        init, alloc = [free_port() for _ in range(TP)], [free_port() for _ in range(TP)]
        decoder = st.sim("decoder", "--model", MODEL)
        timeout = 20 if reachable else 2
        if receiver == "router":
            notify = free_port()
            proxy = notify if reachable else free_port()
            rendered = rendered_lmcache()
            lm = {"notifyPort": notify}
        else:
            zmq_port = free_port()
            sidecar = st.notify_sidecar("sidecar", zmq_port)
            proxy = zmq_port if reachable else free_port()
            rendered = rendered_lmcache(("kvTransfer.lmcache.notificationReceiver=prefillSidecar",))
            lm = {"notificationReceiver": "prefillSidecar", "sidecarPort": sidecar.port, "notifyPort": free_port()}
        harness = start_harness(workdir, "prefiller", rendered, proxy, init, alloc)
        try:
            lm.update(decoderInitPorts=init, decoderAllocPorts=alloc, notifyTimeoutSeconds=timeout)
            router = st.router("router", router_config(workdir, "router", harness.url(), decoder.url(), lm))
            yield Setup(router, decoder, harness)
        finally:
            harness.proc.kill()
            harness.proc.wait(30)


def chat(base: str) -> tuple[str, str]:
    raw = openai.OpenAI(
        base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60
    ).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return raw.parse().choices[0].message.content or "", raw.headers.get("x-pd-route", "")


def metric(proc: Proc, name: str, labels: dict[str, str] | None = None) -> float:
    import urllib.request

    with urllib.request.urlopen(proc.url() + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric_name, _, lab = head.partition("{")
        if metric_name == name and all(f'{k}="{v}"' in lab for k, v in (labels or {}).items()):
            total += float(value)
    return total


def fallbacks(proc: Proc) -> dict[str, float]:
    """pd_router_fallbacks_total by reason, the non-zero ones."""
    import urllib.request

    with urllib.request.urlopen(proc.url() + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith("pd_router_fallbacks_total{"):
            head, _, value = line.rpartition(" ")
            if float(value):
                out[head.split('reason="')[1].split('"')[0]] = float(value)
    return out


@pytest.mark.parametrize("receiver", ["router", "prefillSidecar"])
def test_real_lmcache_senders_notify_the_router_for_the_request_it_named(receiver: str) -> None:
    with lmcache_setup(receiver) as s:
        answer, route = chat(s.router.url())
        assert route == "disaggregated"
        assert answer == chat(s.decoder.url())[0]  # as a single engine would have answered
        assert fallbacks(s.router) == {}
        # LMCache moved the KV of the request id the router put into disagg_spec, every chunk of
        # both TP ranks, intact, into the receivers bound on the ports the router named.
        (req_id,) = s.harness.get("/harness/requests")
        got = s.harness.get(f"/harness/received?req_id={req_id}")
        assert got["expected"] == TP * 3 and got["present"] == got["intact"] == got["expected"], got
        if receiver == "router":
            assert metric(s.router, "pd_router_lmcache_notifications_total", {"result": "matched"}) == TP
        else:
            assert metric(s.router, "pd_router_lmcache_sidecar_waits_total", {"outcome": "ok"}) == 1


@pytest.mark.parametrize("receiver", ["router", "prefillSidecar"])
def test_notifications_that_never_arrive_fall_back_after_the_timeout(receiver: str) -> None:
    with lmcache_setup(receiver, reachable=False) as s:
        answer, route = chat(s.router.url())
        assert route == "fallback"
        assert answer == chat(s.decoder.url())[0]
        assert fallbacks(s.router) == {"notify_timeout": 1}
        # LMCache did its part: the KV landed; only the notification went nowhere.
        (req_id,) = s.harness.get("/harness/requests")
        assert s.harness.get(f"/harness/received?req_id={req_id}")["present"] == TP * 3
