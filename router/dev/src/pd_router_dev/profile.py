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

import re
import shutil
import subprocess
import sys
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


def record(spy: Path, pid: int, seconds: float, out: Path) -> str:
    cmd = [str(spy), "record", "--format", "raw", "--nonblocking", "--subprocesses"]
    cmd += ["--rate", str(RATE), "--duration", str(max(1, round(seconds))), "--pid", str(pid)]
    cmd += ["--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = proc.stderr.strip()[-400:]
        raise RuntimeError(f"py-spy record failed ({proc.returncode}): {tail}")
    return out.read_text()


def rows(target: str, label: str, raw: str, top: int = 8) -> list[dict[str, Any]]:
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
            try:
                raw = record(spy, pid, secs, st.workdir / f"{key}.profile.txt")
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                bench.notes.append(f"no profile of our {label}: {exc}")
                raw = ""
            finally:
                load.kill()
                load.wait(10)
            stop()
            if raw:
                found += rows(key, label, raw)
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"{key}.profile.txt").write_text(raw)
    return found
