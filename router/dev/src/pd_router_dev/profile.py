"""``make bench``'s profile of our router (issue 15: "profile before changing anything; write down
where the time goes"): py-spy samples the router's worker while the bench's load generator
keeps it saturated, and every sample is charged to the code it was running.

One router per route (direct, NIXL), each alone on the router CPUs with one worker, against the
Go zero-delay engine, 32 clients, not streamed (the cells furthest from issue 15's targets).
``py-spy record --format raw --nonblocking`` (the router is never stopped to be read, so the
figures are the router's own, sampled at ``RATE`` Hz; idle samples, the loop waiting in
``epoll``, are not recorded). A sample is charged by its innermost frame's file to one owner
(``OWNERS``, first match): C code (uvloop, orjson, httptools, aiohttp's Cython parser) has no
frame of its own and is charged to the Python function that called it, e.g. a socket write to
the asyncio transport method that made it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RATE = 250  # samples per second
CONCURRENCY = 32

# (owner, path fragments of the innermost frame's file); first match wins, the rest is "other".
OWNERS: Sequence[tuple[str, tuple[str, ...]]] = (
    ("upstream client (pd_router/upstream.py)", ("pd_router/upstream.py",)),
    (
        "metrics (prometheus_client, pd_router/metrics.py)",
        ("prometheus_client/", "pd_router/metrics.py"),
    ),
    ("logging", ("/logging/", "pd_router/logs.py")),
    ("our HTTP server (pd_router/http1.py)", ("pd_router/http1.py",)),
    ("our handler chain (pd_router, the rest)", ("pd_router/",)),
    ("aiohttp (the engines' health checks)", ("aiohttp/",)),
    (
        "event loop, transports and syscalls (asyncio, uvloop)",
        ("asyncio/", "uvloop/", "selectors.py", "socket.py"),
    ),
    ("JSON and the standard library", ("json/", "/python3", "/lib/python")),
)
# The steps of a request's walk through the router (issue 38: what each duty costs), each a list
# of (path fragment of a frame's file, function name prefixes or () for any). A sample goes to
# the step of its innermost frame that matches one, so the C code a step calls (a socket write,
# orjson, a prometheus_client lock) counts for that step.
STEPS: Sequence[tuple[str, Sequence[tuple[str, tuple[str, ...]]]]] = (
    ("HTTP server: reading requests, writing answers", (("pd_router/http1.py", ()),)),
    ("upstream client: the engine call", (("pd_router/upstream.py", ()),)),
    (
        "counting: metrics and the request's outcome",
        (
            ("prometheus_client/", ()),
            ("pd_router/metrics.py", ()),
            ("pd_router/request.py", ("Outcomes.",)),
        ),
    ),
    ("access line and logs", (("/logging/", ()), ("pd_router/logs.py", ()))),
    ("tracing", (("pd_router/tracing.py", ()),)),
    (
        "decision: prompt bound, prefix index, engine choice",
        tuple(
            (f"pd_router/{m}.py", ())
            for m in ("decide", "prefix", "tokens", "plan", "costs", "kv_events", "lengths")
        ),
    ),
    (
        "body parse and validation",
        (("pd_router/openai_wire.py", ()), ("pd_router/app.py", ("Router._parse", "_load_json"))),
    ),
    (
        "auth, body read and admission",
        (
            ("pd_router/admission.py", ()),
            ("pd_router/auth.py", ()),
            ("pd_router/app.py", ("Router._admit", "Router._read_body", "Router._authorized")),
        ),
    ),
    (
        "legs: lease, decoder, relay of the answer",
        tuple(
            (f"pd_router/{m}", ())
            for m in ("legs.py", "lease.py", "handoff/", "discovery.py", "pairs.py", "balancing.py")
        ),
    ),
    (
        "request setup, routing and finishing (app.py, Ctx)",
        (("pd_router/app.py", ()), ("pd_router/request.py", ())),
    ),
    ("event loop and transports (asyncio, uvloop)", (("asyncio/", ()), ("uvloop/", ()))),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_LINE = re.compile(r":\d+\)$")
NO_FRAME = "no Python frame (native code, the GIL released)"


def py_spy() -> Path | None:
    """The py-spy next to this interpreter (router[test] pins it), else on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    if here.exists():
        return here
    found = shutil.which("py-spy")
    return Path(found) if found else None


def owner(frame: str) -> str:
    if frame.startswith("process "):  # py-spy's root frame: the sample had no Python frame
        return NO_FRAME
    m = _FRAME.match(frame.strip())
    path = m.group("file") if m else frame
    for name, fragments in OWNERS:
        if any(f in path for f in fragments):
            return name
    return "other"


def charge(raw: str) -> tuple[Counter[str], Counter[str]]:
    """py-spy's raw (collapsed) stacks → samples per owner, and per innermost function."""
    by_owner: Counter[str] = Counter()
    by_func: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1].strip()
        by_owner[owner(leaf)] += int(count)
        by_func[NO_FRAME if leaf.startswith("process ") else _LINE.sub(")", leaf)] += int(count)
    return by_owner, by_func


def step(frames: Sequence[str]) -> str:
    """The step (``STEPS``) of a sample, by its innermost frame that matches one; ``NO_FRAME``
    when it has no Python frame, "other" when none matches."""
    if frames and frames[-1].strip().startswith("process "):
        return NO_FRAME
    for frame in reversed(frames):
        m = _FRAME.match(frame.strip())
        if m is None:
            continue
        path, func = m.group("file"), m.group("func")
        for name, rules in STEPS:
            for fragment, prefixes in rules:
                if fragment in path and (not prefixes or func.startswith(prefixes)):
                    return name
    return "other"


def by_step(raw: str) -> Counter[str]:
    """py-spy's raw (collapsed) stacks → samples per step of the request's walk."""
    out: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out[step(stack.split(";"))] += int(count)
    return out


def process_cpu(pid: int) -> float:
    """Seconds of CPU ``pid`` has used (user and system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def record(spy: Path, pid: int, seconds: float, out: Path) -> str:
    cmd = [str(spy), "record", "--format", "raw", "--nonblocking", "--subprocesses"]
    cmd += ["--rate", str(RATE), "--duration", str(max(1, round(seconds))), "--pid", str(pid)]
    cmd += ["--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = proc.stderr.strip()[-400:]
        raise RuntimeError(f"py-spy record failed ({proc.returncode}): {tail}")
    return out.read_text()


def rows(
    target: str, label: str, raw: str, top: int = 8, cpu_per_request: float = 0.0
) -> list[dict[str, Any]]:
    """The owners' and the busiest functions' shares of the samples, and each step's share
    with its CPU per request (``cpu_per_request``: the router's, in seconds, over the
    samples' window; 0 = unknown)."""
    by_owner, by_func = charge(raw)
    total = sum(by_owner.values()) or 1
    out: list[dict[str, Any]] = [
        {
            "kind": "profile",
            "target": target,
            "label": label,
            "owner": name,
            "samples": n,
            "share": n / total,
        }
        for name, n in by_owner.most_common()
    ]
    out += [
        {
            "kind": "profile_function",
            "target": target,
            "label": label,
            "function": func,
            "samples": n,
            "share": n / total,
        }
        for func, n in by_func.most_common(top)
    ]
    out += [
        {
            "kind": "profile_step",
            "target": target,
            "label": label,
            "step": name,
            "samples": n,
            "share": n / total,
            "us_per_request": n / total * cpu_per_request * 1e6,
        }
        for name, n in by_step(raw).most_common()
    ]
    return out


def table(found: list[dict[str, Any]]) -> list[str]:
    owners = [r for r in found if r["kind"] == "profile"]
    if not owners:
        return []
    targets = list(dict.fromkeys(r["label"] for r in owners))
    names = [n for n, _ in OWNERS] + [NO_FRAME, "other"]
    share = {(r["label"], r["owner"]): r["share"] for r in owners}
    samples = Counter[str]()
    for r in owners:
        samples[r["label"]] += r["samples"]
    lines = [
        "",
        f"**Where the router's CPU goes** (py-spy {RATE} Hz, non-blocking, one worker, "
        f"{CONCURRENCY} clients, not streamed; each sample charged to its innermost Python "
        "frame's owner, C code to its caller; `pd_router_dev.profile`):",
        "",
        "| owner | " + " | ".join(f"{t} ({samples[t]} samples)" for t in targets) + " |",
        "|---|" + "---:|" * len(targets),
    ]
    for n in names:
        if any((t, n) in share for t in targets):
            cells = [f"{share.get((t, n), 0) * 100:.0f} %" for t in targets]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    for t in targets:
        funcs = [r for r in found if r["kind"] == "profile_function" and r["label"] == t]
        top = "; ".join(f"`{r['function']}` {r['share'] * 100:.0f} %" for r in funcs[:5])
        lines.append("")
        lines.append(f"- {t}, the busiest functions: {top}")
    return lines + step_table(found, targets)


def step_table(found: list[dict[str, Any]], targets: list[str]) -> list[str]:
    """Each step's CPU per request (its share of the samples times the router's CPU per
    request over the same window), per route."""
    steps = [r for r in found if r["kind"] == "profile_step"]
    if not steps:
        return []
    us = {(r["label"], r["step"]): r["us_per_request"] for r in steps}
    share = {(r["label"], r["step"]): r["share"] for r in steps}
    total = {t: sum(v for (label, _), v in us.items() if label == t) for t in targets}
    lines = [
        "",
        "**Where a request's CPU goes, step by step** (the same samples, each charged to the "
        "step of its innermost frame that has one, C code to its caller; µs of the router's "
        "CPU per request over the samples' window, then the share of the samples; "
        "`pd_router_dev.profile.STEPS`):",
        "",
        "| step | " + " | ".join(f"{t} ({total[t]:.0f} µs)" for t in targets) + " |",
        "|---|" + "---:|" * len(targets),
    ]
    for name in [n for n, _ in STEPS] + [NO_FRAME, "other"]:
        if any((t, name) in us for t in targets):
            cells = [
                f"{us.get((t, name), 0):.1f} ({share.get((t, name), 0) * 100:.0f} %)"
                for t in targets
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# A router started for one profiled route: (its URL, its pid, a way to stop it).
Started = tuple[str, int, Callable[[], None]]


def run(
    bench: Any,
    say: Callable[[str], None],
    keep: Path | None,
    start: Callable[[Any, str, dict[str, Any]], Started],
    body: bytes,
) -> list[dict[str, Any]]:
    """Profile our direct and NIXL routes with ``bench``'s CPU sets and arguments (a
    ``pd_router_dev.bench.Bench``), each router alone against a fresh engine: ``start(stack,
    name, config overrides)`` starts one and waits until it answers (the bench's own start),
    ``body`` is what the load generator sends. py-spy's raw stacks are kept in ``keep``
    (``<route>.profile.txt``: flamegraph.pl or speedscope read it)."""
    from pd_router_dev import fastengine
    from pd_router_dev.devstack import Stack, static_pools

    spy = py_spy()
    if spy is None:
        bench.notes.append("no profile: py-spy is not installed (pip install 'pd-router[test]')")
        return []
    secs = bench.args.profile_seconds
    found: list[dict[str, Any]] = []
    with Stack() as st:
        eng, ports, _ = fastengine.start_engine(
            st.workdir, "fe-profile", 2, False, bench.other_cpus
        )
        st.adopt(eng)
        pre, dec = (f"http://127.0.0.1:{p}" for p in ports)
        pools = static_pools([pre], [dec])
        for key, label, threshold in (
            ("ours-direct", "direct route", 1 << 30),
            ("ours-nixl", "NIXL route", 0),
        ):
            over = {"routing": {"connector": "nixl", "threshold": threshold}, "pools": pools}
            url, pid, stop = start(st, f"profile-{key}", over)
            say(f"bench: profiling our {label} ({secs:g} s)")
            load = fastengine.run_load(
                url + "/v1/chat/completions",
                body,
                CONCURRENCY,
                secs + 2,
                0.5,
                False,
                bench.other_cpus,
            )
            cpu_per_request = 0.0
            try:
                cpu0, t0 = process_cpu(pid), time.monotonic()
                raw = record(spy, pid, secs, st.workdir / f"{key}.profile.txt")
                cpu, wall = process_cpu(pid) - cpu0, time.monotonic() - t0
                # the load's rate, steady from its warm-up to its end, past the window
                done = json.loads(load.communicate(timeout=secs + 60)[0])
                cpu_per_request = cpu / (done["rps"] * wall) if done.get("rps") else 0.0
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
                bench.notes.append(f"no profile of our {label}: {exc}")
                raw = ""
            finally:
                load.kill()
                load.wait(10)
            stop()
            if raw:
                found += rows(key, label, raw, cpu_per_request=cpu_per_request)
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"{key}.profile.txt").write_text(raw)
    return found
