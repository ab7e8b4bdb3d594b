"""The simulated engines against a router nobody here wrote: the Rust ``vllm-router`` (PyPI,
pinned in ``router[test]``) in its NIXL PD mode drives one simulated prefiller and one
simulated decoder. It shows the simulator's NIXL hand-off (``kv_transfer_params`` out of the
prefill response, into the decode request) is the one vLLM's own router expects, so what
``make demo``, the tests and ``make bench`` show is not a protocol only our router speaks."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_router_dev.devstack import Proc, Stack, free_port, vllm_router_binary, vllm_router_command
from router_testlib import answer, http_call, long_text, wait_until

PROMPT = long_text(300)


class PeerStack:
    def __init__(self, stack: Stack) -> None:
        self.prefill = stack.sim("vr-prefill", "--kv-connector", "nixl")
        self.decode = stack.sim("vr-decode", "--kv-connector", "nixl")
        assert vllm_router_binary().exists(), "vllm-router is a pinned test dependency"
        self.log = open(stack.workdir / "vllm-router.log", "wb")  # noqa: SIM115
        # Its ports must be chosen before it starts: one taken meanwhile (by another process's
        # connection, while the other pytest worker runs engines) fails its bind; it is started
        # again on other ports, up to three times. Any other exit fails at once.
        for attempt in range(3):
            self.log.seek(0)
            self.log.truncate()  # the log says this attempt's exit only
            self.port = free_port()
            self.proc = subprocess.Popen(
                vllm_router_command(self.prefill.url(), self.decode.url(), self.port),
                stdout=self.log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.url = f"http://127.0.0.1:{self.port}"
            try:
                wait_until(self._up, "vllm-router answers /health")
                return
            except AssertionError as exc:
                if attempt == 2 or "Address already in use" not in str(exc):
                    raise

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"vllm-router exited: {Path(self.log.name).read_text()[-2000:]}")
        try:
            return http_call(self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def peer(stack: Stack) -> Iterator[PeerStack]:
    p = PeerStack(stack)
    try:
        yield p
    finally:
        p.stop()


def _requests(engine: Proc) -> list[dict[str, Any]]:
    out = json.loads(http_call(engine.url() + "/sim/requests?clear=1")[2])
    return [r for r in out if r["path"].startswith("/v1/")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_vllm_router_drives_the_simulated_nixl_handoff(peer: PeerStack, stream: bool) -> None:
    direct = answer(peer.decode.url(), True, PROMPT, stream, max_tokens=8, temperature=0)
    for engine in (peer.prefill, peer.decode):  # forget the direct request
        _requests(engine)
    remote_before = _remote_prefills(peer.decode)
    # the same greedy answer (text and length) through the hand-off
    assert answer(peer.url, True, PROMPT, stream, max_tokens=8, temperature=0)[:2] == direct[:2]
    (pre,) = _requests(peer.prefill)
    (dec,) = _requests(peer.decode)
    assert pre["body"]["kv_transfer_params"]["do_remote_decode"] is True
    kv = dec["body"]["kv_transfer_params"]
    # what the prefiller returned reached the decoder, and the decoder used it
    assert kv["do_remote_prefill"] is True and kv["remote_block_ids"]
    assert kv["remote_engine_id"]
    assert _remote_prefills(peer.decode) == remote_before + 1


def _remote_prefills(engine: Proc) -> float:
    for line in http_call(engine.url() + "/metrics")[2].decode().splitlines():
        if line.startswith("pd_sim_kv_remote_prefill_total "):
            return float(line.split()[1])
    raise AssertionError("pd_sim_kv_remote_prefill_total missing")
