"""``make demo-real`` end to end (tests/real_engine/demo.py): run as the Makefile runs it, it
starts vLLM's CPU build as prefiller and decoder from the chart's render, prints each request's
route and reason, the disaggregated answer beside the colocated one and the decoder's NIXL
counters, exits 0, and leaves no process behind; stopped with SIGTERM while its engines start,
it stops them too. A machine it cannot run on is refused before anything starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines import stack
from tests.real_engine import demo
from tests.real_engine.conftest import Pairs
from tests.real_engine.events import until

TIMEOUT = 900  # two engine starts on a loaded 2-core machine, with room: the hang guard


@pytest.fixture(scope="module")
def alone(pairs: Pairs) -> None:
    pairs.stop()  # the demo's two engines take the machine's two cores (conftest.Pairs)


def _left_in(workdir: Path) -> list[int]:
    """Processes still running that the demo started: the engines run in ``workdir`` (their
    logs' folder), the router names it in its command line (its config and port file)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if Path(os.readlink(d / "cwd")) == workdir or str(workdir) in _cmdline(int(d.name)):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _demo(workdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.real_engine.demo", "--logs", str(workdir)],
        cwd=stack.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def finished(alone: None, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    p = _demo(tmp_path)
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"the demo did not finish in {TIMEOUT} s:\n{out}")
    yield p, out, tmp_path


def test_demo_real_shows_a_disaggregated_answer_equal_to_colocated(
    finished: tuple[subprocess.Popen[str], str, Path],
) -> None:
    p, out, workdir = finished
    assert p.returncode == 0, out
    assert re.search(r"^1\. short prompt: \d+ prompt tokens -> route=direct reason=below_threshold", out, re.M), out
    long = re.search(r"^2\. long prompt: (\d+) prompt tokens -> route=disaggregated reason=above_threshold", out, re.M)
    assert long, out
    answers = re.findall(r"^   answer:    (.*)$", out, re.M)
    (base,) = re.findall(r"^   colocated: (.*) \(the decoder alone\)$", out, re.M)
    assert answers[1] == base and "equal to colocated: yes" in out, out
    moved = re.search(r"(\d+) came over NIXL from the prefiller, (\d+) computed there", out)
    assert moved and moved.groups() == (long.group(1), "0"), out
    # the next turn: the decoder holds the conversation, its KV events say so
    assert re.search(r"^3\. its next turn: .* cached=[1-9]\d* \(events\)", out, re.M), out
    assert _left_in(workdir) == [], "the demo left processes running"


def test_demo_real_stopped_by_sigterm_stops_its_engines(alone: None, tmp_path: Path) -> None:
    p = _demo(tmp_path)
    try:
        assert p.stdout is not None
        seen = ""
        for line in p.stdout:  # until it starts its engines (the demo says so), or it ends
            seen += line
            if "starting vLLM" in line:
                break
        assert "starting vLLM" in seen, seen
        # stopped while its engines load (half a minute sooner than once they serve): the same
        # stop, the engines' process groups, must end them mid-start too
        until("the demo's two engines started", lambda: len(_left_in(tmp_path)) >= 2, timeout=60)
        p.send_signal(signal.SIGTERM)
        p.wait(120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    assert p.returncode == 128 + signal.SIGTERM
    try:
        until("every process the demo started exited", lambda: not _left_in(tmp_path), timeout=30)
    except AssertionError as exc:
        left = {pid: _cmdline(pid) for pid in _left_in(tmp_path)}
        for pid in left:  # what it left would take the cores from the rest of the tier
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"{exc}: left running {left}") from None


def test_a_machine_that_cannot_run_the_cpu_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert demo.refusal() is None  # this machine runs it (the tier does)
    monkeypatch.setattr(demo.platform, "machine", lambda: "arm64")
    why = demo.refusal()
    assert why is not None and "Linux x86-64" in why and "make demo" in why
    assert demo.main([]) == 2  # refused before anything starts
