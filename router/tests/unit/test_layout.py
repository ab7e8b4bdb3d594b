"""The router's shape, kept by checks rather than by hand: endpoint load is written only by
the lease, the runtime never imports development code, and the runtime distribution (what
the image installs) holds no simulator, demo or benchmark."""

from __future__ import annotations

import ast
from pathlib import Path

from setuptools import find_packages

ROUTER = Path(__file__).resolve().parents[2]
RUNTIME = ROUTER / "src" / "pd_router"


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(f, ast.parse(f.read_text())) for f in sorted(RUNTIME.rglob("*.py"))]


def test_only_the_lease_changes_endpoint_load() -> None:
    writers = set()
    for f, tree in _modules():
        for node in ast.walk(tree):
            targets = (
                [node.target]
                if isinstance(node, ast.AugAssign)
                else node.targets
                if isinstance(node, ast.Assign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in ("active", "queued_tokens"):
                    is_init = isinstance(t.value, ast.Name) and t.value.id == "self"
                    writers.add(f.relative_to(RUNTIME).as_posix() + (" (init)" if is_init else ""))
    # discovery.Endpoint sets both to 0 when it is created; nothing else but the lease writes them
    assert writers == {"lease.py", "discovery.py (init)"}


def test_the_runtime_never_imports_development_code() -> None:
    offenders = []
    for f, tree in _modules():
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{f.name}: {n}" for n in names if n.split(".")[0] == "pd_router_dev"]
    assert offenders == []


def test_the_runtime_distribution_and_image_hold_no_development_code() -> None:
    packages = set(find_packages(str(ROUTER / "src")))
    assert packages == {"pd_router", "pd_router.handoff"}
    files = {f.name for f in RUNTIME.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert not files & {"devstack.py", "bench.py", "demo.py", "demo-config.yaml"}
    copies = [
        ln.split()[1:]
        for ln in (ROUTER / "Dockerfile").read_text().splitlines()
        if ln.startswith("COPY ") and "--from" not in ln
    ]
    assert copies == [["pyproject.toml", "README.md", "./"], ["src", "./src"]]


# A function longer than this is several functions: split it where its parts have names.
MAX_FUNCTION_LINES = 80


def _functions() -> dict[str, int]:
    """Every function of the runtime, ``file:Class.name`` -> its length in lines."""
    out: dict[str, int] = {}
    for f, tree in _modules():
        rel = f.relative_to(RUNTIME).as_posix()
        for cls in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            prefix = f"{cls.name}." if isinstance(cls, ast.ClassDef) else ""
            for n in cls.body:
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[f"{rel}:{prefix}{n.name}"] = n.end_lineno - n.lineno + 1  # type: ignore[operator]
    return out


def test_no_function_of_the_runtime_is_longer_than_the_cap() -> None:
    funcs = _functions()
    long = sorted(k for k, n in funcs.items() if n > MAX_FUNCTION_LINES)
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"
    assert funcs["kv_events.py:_Subscriber.run"] < MAX_FUNCTION_LINES  # the walk finds methods


def _callers(attrs: set[str]) -> dict[str, set[str]]:
    """Where the runtime calls a method named in ``attrs``: name -> ``file:Class.function``
    (``file:`` alone for a call outside every function)."""
    out: dict[str, set[str]] = {a: set() for a in attrs}

    def calls(node: ast.AST) -> list[ast.Call]:
        return [
            n
            for n in ast.walk(node)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in attrs
        ]

    for f, tree in _modules():
        rel = f.relative_to(RUNTIME).as_posix()
        seen: set[ast.Call] = set()
        for cls in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            prefix = f"{cls.name}." if isinstance(cls, ast.ClassDef) else ""
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    for c in calls(fn):
                        out[c.func.attr].add(f"{rel}:{prefix}{fn.name}")  # type: ignore[attr-defined]
                        seen.add(c)
        for c in set(calls(tree)) - seen:
            out[c.func.attr].add(f"{rel}:")  # type: ignore[attr-defined]
    return out


def test_engine_health_is_reported_from_one_place() -> None:
    """A leg's outcome for its engine reaches the engine's pool through Legs.engine_ok and
    Legs.engine_failed alone, so what counts as a success or a failure is read in one place
    (LMCache's prefill succeeds once its notification came, not on its answer)."""
    calls = _callers({"report_success", "report_failure"})
    assert calls == {
        "report_success": {"legs.py:Legs.engine_ok"},
        "report_failure": {"legs.py:Legs.engine_failed"},
    }, calls
    defined = {k for k in _functions() if k.split(".")[-1] in calls}
    assert defined == {
        "discovery.py:EndpointPool.report_success",
        "discovery.py:EndpointPool.report_failure",
    }, defined


def _imports(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
    return out


def test_the_http_surface_names_no_hand_off_protocol() -> None:
    """app.py reaches the hand-offs through pd_router.handoff alone (build_route picks one),
    so a third protocol touches no line of it."""
    (tree,) = [t for f, t in _modules() if f == RUNTIME / "app.py"]
    protocols = {m.stem for m in (RUNTIME / "handoff").glob("*.py") if m.stem != "__init__"}
    assert {"direct", "nixl", "lmcache"} <= protocols  # the walk sees the protocol modules
    named = {i for i in _imports(tree) if i.startswith("pd_router.handoff.")}
    assert not {i.split(".")[2] for i in named} & protocols, named


def test_only_the_finishing_place_counts_requests() -> None:
    """pd_router_requests_total is written in Outcomes.finish alone (and preset at 0 by
    Metrics, the remote route's where there are remote models): a request is counted once,
    where it ends."""
    writers = set()
    for f, tree in _modules():
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
                for n in ast.walk(fn):
                    if isinstance(n, ast.Attribute) and n.attr == "requests":
                        writers.add(f"{f.relative_to(RUNTIME).as_posix()}:{cls.name}.{fn.name}")
    assert writers == {
        "metrics.py:Metrics._declare_requests",
        "metrics.py:Metrics._preset",
        "metrics.py:Metrics.remote_models",
        "request.py:Outcomes.finish",
    }, writers


def test_a_requests_outcome_is_recorded_by_the_downstream_alone() -> None:
    """No route's exit marks its own outcome: what reached the client is recorded by
    legs.Downstream (and, for a client gone before any answer, by the app)."""
    marks = {"replied", "stream_ended", "stream_failed", "client_gone"}
    callers = set()
    for f, tree in _modules():
        for cls in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            prefix = f"{cls.name}." if isinstance(cls, ast.ClassDef) else ""
            for fn in cls.body:
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for n in ast.walk(fn):
                    call = isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    if call and n.func.attr in marks:  # type: ignore[attr-defined]
                        callers.add(f"{f.relative_to(RUNTIME).as_posix()}:{prefix}{fn.name}")
    assert {c.split(":")[1].split(".")[0] for c in callers if c.startswith("legs.py")} == {
        "Downstream"
    }, callers
    assert {c for c in callers if not c.startswith("legs.py:Downstream.")} == {
        "app.py:Router._handle"
    }, callers


def test_the_dev_package_reaches_no_other_folder_by_path() -> None:
    """router/dev is a package of its own: it imports nothing from ci/ or tests/ and puts no
    folder on sys.path (what it needs, a tool's path, is given to it: otelcol.binary)."""
    dev = ROUTER / "dev" / "src"
    for f in sorted(dev.rglob("*.py")):
        tree = ast.parse(f.read_text())
        bad = [i for i in _imports(tree) if i.split(".")[0] in ("ci", "tests")]
        assert not bad, (f.name, bad)
        assert "sys.path" not in f.read_text(), f.name


def test_the_router_is_assembled_not_decided_in_its_constructor() -> None:
    """Every choice the config makes is pd_router.wiring's: ``Router.__init__`` holds no
    ``if``, so a new option lands there, not in the HTTP surface."""
    tree = ast.parse((RUNTIME / "app.py").read_text())
    router = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Router")
    init = next(n for n in router.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    branches = [n.lineno for n in ast.walk(init) if isinstance(n, ast.If | ast.IfExp)]
    assert branches == []
