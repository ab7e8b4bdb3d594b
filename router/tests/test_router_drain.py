"""A decoder scaled down under load, in the order the chart sets (docs/operating.md "Draining
engines"): its pod leaves the headless Service's DNS answer, the router's discovery drops it
within ``dns.refreshSeconds``, the pod's preStop wait outlasts that, and only then does the engine
get SIGTERM. Real router process with DNS discovery (the name resolved from a hosts file the test
rewrites: tests/hosts_site), two simulated decoders on one port at two addresses as two pods are,
the official openai client as the callers. The simulator exits at SIGTERM without draining (vLLM
drains with --shutdown-timeout: tests/real_engine/test_real_drain.py), so a request the router
sent after the drop would fail here: none may."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import openai

from pd_router_dev.devstack import Stack
from pd_router_dev.sim.server import REQUESTS_KEPT
from router_testlib import MODEL, http_call, long_text, metric_value, wait_until, write_config

HOSTS_SITE = Path(__file__).parent / "hosts_site"
NAME = "decode.pd.test"
REFRESH = 0.5  # the router's dns.refreshSeconds here (the chart's default is 10)
PRESTOP = REFRESH + 1.5  # refresh, plus the DNS cache the chart adds (7 s there; none here)


def _records(base: str) -> list[dict[str, Any]]:
    _, _, raw = http_call(base + "/sim/requests")
    records: list[dict[str, Any]] = json.loads(raw)
    assert len(records) < REQUESTS_KEPT, "the simulator keeps only its last requests"
    return records


def _served(base: str) -> int:
    return len(_records(base))


def test_no_request_fails_while_a_decoder_is_scaled_down_under_load(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    with Stack(tmp_path) as st:
        args = ("--kv-connector", "nixl", "--decode-step-ms", "10")
        d0 = st.sim("drain-d0", *args, "--host", "127.0.0.2")
        d1 = st.sim("drain-d1", *args, "--host", "127.0.0.3", "--port", str(d0.port))
        pre = st.sim("drain-p", *args)
        hosts.write_text(f"127.0.0.2 {NAME}\n127.0.0.3 {NAME}\n")
        cfg = {
            "routing": {"connector": "nixl", "threshold": 256, "decision": "length"},
            "pools": {
                "prefill": {"discovery": "static", "static": [pre.url()]},
                "decode": {
                    "discovery": "dns",
                    "dns": {"name": NAME, "port": d0.port, "refreshSeconds": REFRESH},
                },
            },
            "health": {"intervalSeconds": 0.5},
        }
        pythonpath = os.pathsep.join(
            p for p in (str(HOSTS_SITE), os.environ.get("PYTHONPATH", "")) if p
        )
        # asyncio's loop: uvloop resolves in C, past the shim (discovery is the same code)
        env = {
            "PD_TEST_HOSTS": str(hosts),
            "PYTHONPATH": pythonpath,
            "PD_ROUTER_EVENT_LOOP": "asyncio",
        }
        router = st.router("drain-router", write_config(tmp_path, "drain-router", cfg), env)
        endpoints = 'pd_router_healthy_endpoints{pool="decode"}'
        wait_until(
            lambda: (
                metric_value(router.url(), "pd_router_healthy_endpoints", {"pool": "decode"}) == 2
            ),
            endpoints,
        )

        stop = threading.Event()
        done: list[str] = []
        failed: list[str] = []

        def caller(i: int) -> None:
            c = openai.OpenAI(
                base_url=router.url() + "/v1", api_key="none", max_retries=0, timeout=30
            )
            n = 0
            while not stop.is_set():
                n += 1
                text = long_text() if n % 3 == 0 else f"caller {i} request {n}"
                try:
                    parts = []
                    with c.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": text}],
                        max_tokens=12,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    ) as s:
                        for chunk in s:
                            parts.extend(ch.delta.content or "" for ch in chunk.choices)
                    (done if parts else failed).append(text)
                except Exception as exc:  # every failure is counted, none may happen
                    failed.append(f"{text[:30]}: {exc!r}")

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for t in callers:
            t.start()
        try:
            wait_until(lambda: _served(d1.url("127.0.0.3")) >= 5, "load reaches decoder 1")
            # the pod is terminating: not ready, out of the Service's DNS answer
            hosts.write_text(f"127.0.0.2 {NAME}\n")
            t_out = time.monotonic()
            wait_until(
                lambda: metric_value(router.url(), "pd_router_endpoints", {"pool": "decode"}) == 1,
                "the router drops the decoder that left DNS",
            )
            seen = _served(d1.url("127.0.0.3"))
            # the kubelet runs the preStop wait before SIGTERM: that wait is the behaviour here
            time.sleep(max(0.0, PRESTOP - (time.monotonic() - t_out)))
            late = _records(d1.url("127.0.0.3"))[seen:]
            d1.popen.terminate()  # SIGTERM (not waited for: the load goes on meanwhile)
            before = len(done)
            wait_until(lambda: len(done) >= before + 20, "the load goes on on decoder 0")
        finally:
            stop.set()
            for t in callers:
                t.join(60)
    assert not failed, failed[:5]
    # nothing new sent to it once the router had dropped it: only the decode legs of hand-offs
    # that chose it before (their prefill ran meanwhile), which the preStop wait is there for
    # (each caller has at most one in flight)
    legs = [r for r in late if "kv_transfer_params" in r["body"]]
    assert len(legs) == len(late) <= len(callers), [r["body"] for r in late]
    assert len(done) > 25
