"""The real-engine tier (pytest marker ``real_vllm``): vLLM's CPU build as prefiller and decoder,
KV moved between them by NixlConnector over UCX, the project's router in front, the official
``openai`` client as the caller. Every test here is marked ``real_vllm`` and runs on one pytest
worker (one xdist group), since two engines take the machine's two cores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_router_dev.devstack import Proc

from tests.real_engine import engines
from tests.real_engine.routers import Routers, chart_router_config

HERE = Path(__file__).resolve().parent
# The flexible layout as the chart renders it on the dev environment (tests/scenarios/
# flexible.yaml): one pool of decode engines, each NixlConnector kv_both, the goodput decision.
FLEX = "scenario:flexible"
FLEX_ROLE = "decode"


# Modules that run last, in this order, so the dense pair starts once and stops once (Pairs):
# test_real_kv_events.py is the dense pair's last user (it replaces the decoder, then stops the
# pair); test_real_lmcache_mp.py starts a pair of its own (LMCache's MP mode, vLLM's dev mode);
# test_real_demo.py runs `make demo-real`, which starts engines of its own;
# test_real_flex.py starts the flexible layout's pair (two kv_both engines, FLEX), its
# last test killing one; test_real_tracing.py starts a pair of its own (tracing on); the others
# need the machine to themselves (no dense pair).
LAST = (
    "test_real_kv_events.py",
    "test_real_lmcache_mp.py",
    "test_real_demo.py",
    "test_real_flex.py",
    "test_real_tracing.py",
    "test_real_drain.py",
    "test_real_revision.py",
    "test_real_lmcache.py",
    "test_real_hybrid.py",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = []
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.real_vllm)
            item.add_marker(pytest.mark.xdist_group("real-vllm"))
            ours.append(item)
    rank = {name: i + 1 for i, name in enumerate(LAST)}
    order = sorted(ours, key=lambda it: rank.get(Path(str(it.fspath)).name, 0))  # stable
    slots = iter(order)
    items[:] = [next(slots) if it in ours else it for it in items]


@pytest.fixture(autouse=True)
def _one_worker(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup`` pytest-xdist renames each grouped item ``<id>@real-vllm``; a
    pytest that ignores the rename (9.2 with xdist 3.8) would run two engine pairs at once."""
    if request.config.getoption("dist", "no") == "loadgroup":
        assert request.node.nodeid.endswith("@real-vllm"), (
            f"{request.node.nodeid} is not in xdist group real-vllm: the real-engine tier would "
            "run on both workers at once (see requirements-dev.txt's pytest pin)"
        )


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-vllm")


class Pairs:
    """At most one prefiller/decoder pair runs at a time: a pair takes the machine's two cores
    (one each) and about 6 GB, and CI's other pytest worker runs control planes meanwhile (two
    pairs at once left a 24 GB machine without memory)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.kind: tuple[str, str] | None = None
        self.pair: dict[str, engines.Engine] = {}

    def get(
        self, kind: str, render: str = engines.RENDER, otlp: str = "", decode_render: str = ""
    ) -> dict[str, engines.Engine]:
        """The pair of model ``kind`` as ``render`` renders it (``otlp``: its collector), the
        decoder as ``decode_render`` does when given (two releases of one rollout)."""
        if self.kind != (kind, render + "|" + decode_render):
            self.stop()
            pair = [
                engines.engine("prefill", kind, 0, self.workdir, render=render, otlp=otlp),
                engines.engine("decode", kind, 1, self.workdir, render=decode_render or render, otlp=otlp),
            ]
            try:
                for e in pair:
                    e.start()
                engines.wait_ready(pair)
            except BaseException:
                for e in pair:
                    e.stop()
                raise
            self.kind, self.pair = (kind, render + "|" + decode_render), {e.role: e for e in pair}
        return self.pair

    def flexible(self, kind: str) -> list[engines.Engine]:
        """Two engines of the flexible layout (FLEX: one pool, NixlConnector kv_both), model
        ``kind``, on cores 0 and 1."""
        if self.kind != (kind, FLEX):
            self.stop()
            pair = [engines.engine(FLEX_ROLE, kind, core, self.workdir, render=FLEX) for core in (0, 1)]
            try:
                for e in pair:
                    e.start()
                engines.wait_ready(pair)
            except BaseException:
                for e in pair:
                    e.stop()
                raise
            self.kind, self.pair = (kind, FLEX), {f"flex-{i}": e for i, e in enumerate(pair)}
        return list(self.pair.values())

    def stop(self) -> None:
        for e in self.pair.values():
            e.stop()
        self.kind, self.pair = None, {}


@pytest.fixture(scope="session")
def pairs(workdir: Path) -> Iterator[Pairs]:
    p = Pairs(workdir)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def pd(pairs: Pairs) -> dict[str, engines.Engine]:
    """A dense-model prefiller (core 0) and decoder (core 1), as the dev environment renders them."""
    return pairs.get("dense")


@pytest.fixture(scope="session")
def routers(workdir: Path) -> Iterator[Routers]:
    r = Routers(workdir)
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module", autouse=True)
def _module_routers(routers: Routers) -> Iterator[None]:
    """A module's routers stop at its end. Left running, a router
    still checks the session's engines, and one that re-admits an engine after a slow check
    probes its weights with a real completion: engine counters a later test reads would move."""
    mark = routers.mark()
    yield
    routers.stop_since(mark)


@pytest.fixture(scope="module")
def router(pd: dict[str, engines.Engine], routers: Routers) -> Proc:
    """The chart's dev router (NIXL route, threshold 512) in front of the dense pair."""
    return routers.start([pd["prefill"].url], [pd["decode"].url])


@pytest.fixture(scope="session")
def model_name() -> str:
    """The served model name the chart renders (`model.servedName`), which both engines answer to."""
    return chart_router_config()["model"]["servedName"]
