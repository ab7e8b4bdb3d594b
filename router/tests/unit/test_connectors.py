"""The connector registry (pd_router.connectors) is the one place the router names a KV
hand-off protocol: each entry builds its own route, and no other module compares a name, so a
third protocol touches the registry and its own modules. tests/test_connectors.py checks the
chart's list against it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fakes import World

from pd_router import handoff
from pd_router.config import parse_config
from pd_router.connectors import CONNECTORS, DEFAULT, NAMES
from pd_router.handoff.direct import DirectRoute

RUNTIME = Path(__file__).resolve().parents[2] / "src" / "pd_router"


@pytest.mark.parametrize("receiver", ["router", "prefillSidecar"])
@pytest.mark.parametrize("name", NAMES)
def test_each_connector_builds_the_route_of_its_own_module(name: str, receiver: str) -> None:
    w = World()
    cfg = parse_config(
        {"routing": {"connector": name}, "lmcache": {"notificationReceiver": receiver}}
    )
    route = handoff.build_route(cfg, w.legs, DirectRoute(w.legs))
    assert type(route).__module__ == CONNECTORS[name].route
    assert all(callable(getattr(route, m, None)) for m in ("serve", "start", "stop"))


def test_the_config_takes_the_registry_names_and_its_default() -> None:
    assert DEFAULT in CONNECTORS
    assert parse_config({}).routing.connector == DEFAULT
    for name in NAMES:
        assert parse_config({"routing": {"connector": name}}).routing.connector == name


def _owner(path: Path) -> str | None:
    """The connector a runtime module belongs to: handoff/<name>.py and handoff/<name>_*.py."""
    rel = path.relative_to(RUNTIME)
    if rel.parts[0] != "handoff":
        return None
    return next((n for n in CONNECTORS if rel.stem == n or rel.stem.startswith(f"{n}_")), None)


def test_no_module_but_the_registry_and_the_connectors_own_names_a_connector() -> None:
    named = set()
    for f in sorted(RUNTIME.rglob("*.py")):
        if f.name == "connectors.py" and f.parent == RUNTIME:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            foreign = isinstance(node, ast.Constant) and node.value in CONNECTORS
            if foreign and _owner(f) != node.value:
                named.add(f"{f.relative_to(RUNTIME).as_posix()}:{node.lineno} {node.value!r}")
    assert not named, sorted(named)
