"""Interop with software nobody here wrote: the router drives llm-d-inference-sim in nixl mode.

The binary comes from ``router/tools/install-llm-d-sim.sh`` (``make tools``); when it could not
be installed, the test is skipped with the installer's recorded reason.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_router_dev.devstack import Stack, free_port
from router_testlib import MODEL, client, http_call, write_config

REPO = Path(__file__).resolve().parents[2]
SIM_DIR = REPO / ".tools" / "llm-d-inference-sim"
SIM_BIN = SIM_DIR / "llm-d-inference-sim"


def _skip_reason() -> str:
    note = SIM_DIR / "UNAVAILABLE"
    if note.exists():
        return "llm-d-inference-sim not installed: " + note.read_text().strip()
    return (
        f"llm-d-inference-sim not installed at {SIM_BIN}: run "
        "router/tools/install-llm-d-sim.sh (make tools)"
    )


@pytest.fixture(scope="module")
def llmd(stack: Stack) -> Iterator[list[str]]:
    if not SIM_BIN.exists():
        pytest.skip(_skip_reason())
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(stack.workdir / f"llmd{i}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [str(SIM_BIN), "--port", str(port), "--model", MODEL],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            end = time.monotonic() + 60
            while True:
                try:
                    if http_call(url + "/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > end:
                    pytest.fail(f"llm-d-inference-sim at {url} did not start")
                time.sleep(0.1)
        yield urls
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def test_router_drives_llm_d_sim_in_nixl_mode(stack: Stack, llmd: list[str]) -> None:
    cfg = {
        "routing": {"connector": "nixl", "threshold": 0},
        "pools": {
            "prefill": {"discovery": "static", "static": [llmd[0]]},
            "decode": {"discovery": "static", "static": [llmd[1]]},
        },
    }
    router = stack.router("llmd-router", write_config(stack.workdir, "llmd-router", cfg))
    c = client(router)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello from pd-router"}], max_tokens=8
    )
    assert raw.headers["x-pd-route"] in ("disaggregated", "fallback")
    assert raw.parse().choices[0].message.content
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=8,
            stream=True,
        )
    )
    assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)
