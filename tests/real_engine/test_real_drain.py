"""The engines' drain on vLLM's CPU build (0.31.0), with the command line the chart renders: on
SIGTERM, the signal the kubelet sends after the preStop wait (docs/operating.md "Draining
engines"), vLLM refuses new requests and finishes the stream it has in flight, because the chart
passes ``--shutdown-timeout`` (``decode.drainSeconds``); with vLLM's own default, 0, the same
stream is cut. SIGTERM goes to the engine's main process only, as the kubelet sends it to the
container's PID 1 (the preflight execs vLLM, so that is vLLM's API server)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests import helm
from tests.cases import LAYERINGS
from tests.real_engine import engines
from tests.real_engine.conftest import Pairs
from tests.real_engine.prompts import client, text

TOKENS = 160  # a stream that outlives the SIGTERM by a few seconds on one CPU core


@pytest.fixture(scope="module")
def alone(pairs: Pairs) -> None:
    pairs.stop()  # one engine at a time, on the machine alone (conftest.Pairs)


def _decoder(workdir: Path, extra: tuple[str, ...] = ()) -> engines.Engine:
    return engines.engine("decode", "dense", 1, workdir, extra=extra)


def _stream_across_sigterm(e: engines.Engine, model: str) -> dict[str, Any]:
    """A stream of TOKENS tokens, SIGTERM to the engine after its first chunk; what the stream
    got, what a request sent during the drain got, and how the process ended."""
    assert e.popen is not None
    out: dict[str, Any] = {"chunks": 0, "tokens": None, "finish": None, "error": None}
    first = threading.Event()

    def read() -> None:
        try:
            # A bounded wait: without the chart's flag the stream stops but stays open (the control).
            stream = (
                client(e.url)
                .with_options(timeout=45)
                .completions.create(
                    model=model,
                    prompt=text("drain", 40),
                    max_tokens=TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
            )
            for chunk in stream:
                out["chunks"] += 1
                first.set()
                if chunk.usage is not None:
                    out["tokens"] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    out["finish"] = choice.finish_reason or out["finish"]
        except (openai.APIError, OSError) as exc:
            out["error"] = repr(exc)
        finally:
            out["ended"] = time.monotonic()
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(120), "no first chunk"
    os.kill(e.popen.pid, signal.SIGTERM)
    sent = time.monotonic()
    time.sleep(1)
    try:
        late = client(e.url).with_options(timeout=30).completions.create(model=model, prompt="late", max_tokens=4)
        out["late"] = f"answered, finish {late.choices[0].finish_reason}"
    except (openai.APIError, OSError) as exc:
        out["late"] = f"refused: {type(exc).__name__}"
    reader.join(120)
    out["exit"] = e.popen.wait(120)
    out["exit_seconds"] = time.monotonic() - sent
    out["stream_seconds"] = out.pop("ended") - sent  # from SIGTERM to the stream's end
    print(f"drain {e.extra or 'chart'}: {out}")  # the figures, for the record (pytest -s)
    return out


@pytest.fixture
def decoder(alone: None, workdir: Path, request: pytest.FixtureRequest) -> Iterator[engines.Engine]:
    e = _decoder(workdir, request.param)
    try:
        e.start()
        engines.wait_ready([e])
        yield e
    finally:
        e.stop()


@pytest.mark.parametrize("decoder", [()], indirect=True, ids=["chart"])
def test_sigterm_finishes_the_stream_in_flight_and_refuses_new_requests(
    decoder: engines.Engine, model_name: str
) -> None:
    args = engines.chart_engine("decode").args
    assert "--shutdown-timeout=90" in args  # decode.drainSeconds, as the chart renders it
    pod = helm.one(helm.render(helm.helm_binaries()[0], LAYERINGS[engines.RENDER]), "StatefulSet", "-decode")
    spec = pod["spec"]["template"]["spec"]
    wait = int(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1].split("(")[1].rstrip(")"))
    kill_at = spec["terminationGracePeriodSeconds"] - wait  # SIGKILL, counted from the SIGTERM
    got = _stream_across_sigterm(decoder, model_name)
    assert got["error"] is None and got["finish"] == "length" and got["tokens"] == TOKENS, got
    assert got["late"].startswith("refused") or "abort" in got["late"], got  # nothing new is served
    # It exits once the stream is done (nothing left to wait for), teardown included, before the
    # kubelet's SIGKILL would come.
    assert got["exit"] == 0 and got["exit_seconds"] < kill_at, (got, kill_at)


@pytest.mark.parametrize("decoder", [("--shutdown-timeout=0",)], indirect=True, ids=["vllm-default"])
def test_without_the_charts_flag_sigterm_cuts_the_stream(decoder: engines.Engine, model_name: str) -> None:
    """The control: vLLM's default (0, "abort" in v1/engine/core.py _handle_shutdown) ends the
    stream early; this is what the chart's --shutdown-timeout prevents. (Measured here: one chunk,
    then the stream stays open without tokens until the client gives up, and vLLM exits only
    then: in a pod, at the kubelet's SIGKILL.)"""
    got = _stream_across_sigterm(decoder, model_name)
    assert got["error"] is not None or got["finish"] == "abort" or (got["tokens"] or 0) < TOKENS, got
