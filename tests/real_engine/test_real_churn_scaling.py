"""Pools scaled under load (issue 36), as the chart scales them. The router finds each role's
engines by DNS (``pools.*.discovery: dns``, the headless Service of the role's StatefulSet): a
pod that turns ready joins the Service's answer; one that terminates leaves it, and its preStop
wait outlasts the router's refresh before vLLM gets SIGTERM and drains (docs/operating.md
"Draining engines"). Here each engine listens at a loopback address of its own on its pool's
one port, as pods do, and the router resolves the chart's own Service names from a hosts file
the test rewrites (router/tests/hosts_site: a name it does not list is NXDOMAIN), refreshed
every second (the chart's 10 s would only make the test wait):

    decode 1 -> 2   a second decoder turns ready and joins the answer: it takes hand-offs
    decode 2 -> 1   it leaves the answer; once the router has dropped it, SIGTERM (vLLM drains)
    prefill 1 -> 0  the prefiller leaves the answer (NXDOMAIN: no ready endpoint); once the
                    router has emptied the pool, SIGTERM; long prompts are served whole
    prefill 0 -> 1  a new prefiller joins: disaggregated again

The tests run in this order, each from the fleet the one before left (a module's state, as the
churn steps follow one another). All under the churn tests' load (tests/real_engine/load.py): every answer the decoder's own,
every error OpenAI-shaped; a scale-down in the chart's order may cost no request at all; once a
pool is whole again, the next long prompts are all disaggregated. The new prefiller stays the
dense pair's for the modules after this one, so it takes the old one's address (127.0.0.1, which
the observability tier's scrape targets assume): to the router, whose pool was emptied, it is a
new endpoint all the same."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pd_router_dev.devstack import Proc

from tests.engines import stack
from tests.real_engine import engines
from tests.real_engine.load import Load, disaggregated_again, metric, running, until
from tests.real_engine.prompts import LONG_WORDS, ask, colocated, text
from tests.real_engine.routers import Routers, chart_router_config

HOSTS_SITE = stack.ROOT / "router" / "tests" / "hosts_site"
REFRESH_SECONDS = "1"
SECOND_DECODER = "127.0.0.2"  # the second decoder pod's address (the first keeps 127.0.0.1)


@dataclass
class Fleet:
    """The engines each pool's Service answers with, and the router that resolves them."""

    hosts: Path
    names: dict[str, str]  # pool -> the chart's Service name
    members: dict[str, list[engines.Engine]]
    router: Proc
    spare: list[engines.Engine] = field(default_factory=list)  # started here, stopped after

    def publish(self) -> None:
        """The Services' answers now (written whole, then renamed: a lookup never reads half)."""
        lines = [f"{e.host} {self.names[pool]}" for pool, es in self.members.items() for e in es]
        new = self.hosts.with_suffix(".new")
        new.write_text("".join(f"{line}\n" for line in lines))
        new.replace(self.hosts)

    def endpoints(self, pool: str, healthy: bool = False) -> float:
        return metric(self.router, "pd_router_healthy_endpoints" if healthy else "pd_router_endpoints", pool=pool)


@pytest.fixture(scope="module")
def fleet(pd: dict[str, engines.Engine], routers: Routers, workdir: Path) -> Iterator[Fleet]:
    pools = chart_router_config()["pools"]
    hosts = workdir / "scaling-hosts"
    names = {pool: pools[pool]["dns"]["name"] for pool in ("prefill", "decode")}
    hosts.write_text("".join(f"{pd[pool].host} {name}\n" for pool, name in names.items()))
    dns = {}
    for pool in ("prefill", "decode"):
        key = f"PD_ROUTER__POOLS__{pool.upper()}"
        dns |= {
            f"{key}__DISCOVERY": "dns",
            f"{key}__DNS__PORT": str(pd[pool].port),
            f"{key}__DNS__REFRESHSECONDS": REFRESH_SECONDS,
        }
    router = routers.start(
        [pd["prefill"].url],  # (the static lists the helper sets are unused: discovery is dns)
        [pd["decode"].url],
        env={
            **dns,
            "PD_TEST_HOSTS": str(hosts),
            "PYTHONPATH": os.pathsep.join(p for p in (str(HOSTS_SITE), os.environ.get("PYTHONPATH", "")) if p),
            # asyncio's loop: uvloop resolves in C, past the shim (discovery is the same code)
            "PD_ROUTER_EVENT_LOOP": "asyncio",
        },
    )
    f = Fleet(hosts, names, {"prefill": [pd["prefill"]], "decode": [pd["decode"]]}, router)
    # (routers.start returned once the router admitted the pair it resolved)
    try:
        yield f
    finally:
        for e in f.spare:
            e.stop()


@pytest.fixture
def load(fleet: Fleet, model_name: str, request: pytest.FixtureRequest) -> Iterator[Load]:
    with running(fleet.router, model_name, request.node.name) as ld:
        yield ld


def drained(e: engines.Engine) -> float:
    """SIGTERM to the engine's main process, as the kubelet sends it after the preStop wait;
    seconds until vLLM has drained and exited."""
    assert e.popen is not None
    t0 = time.monotonic()
    os.kill(e.popen.pid, signal.SIGTERM)
    e.popen.wait(120)
    took = time.monotonic() - t0
    e.stop()  # whatever of its tree is left
    return took


def test_churn_the_decode_pool_scaled_1_to_2(
    fleet: Fleet, pd: dict[str, engines.Engine], workdir: Path, load: Load
) -> None:
    d1 = engines.engine("decode", "dense", 1, workdir, port=pd["decode"].port, host=SECOND_DECODER)
    fleet.spare.append(d1)
    d1.start()
    engines.wait_ready([d1])  # the pod turns ready: the Service lists it
    fleet.members["decode"].append(d1)
    fleet.publish()
    load.fault()
    admitted = until("the router admits the second decoder", lambda: fleet.endpoints("decode", True) == 2)
    pulled = until(
        "the second decoder takes a hand-off", lambda: engines.by_source(d1)["external_kv_transfer"] > 0, 120
    )
    print(
        f"churn: decode 1 -> 2: admitted {admitted:.1f} s after it joined DNS, its first KV pulled {pulled:.1f} s later"
    )
    print(f"churn: decode 1 -> 2: {load.settle(time.monotonic())}")
    print(f"churn: decode 1 -> 2, {load.check(pd['decode'].url, errors=False)}")


def test_churn_the_decode_pool_scaled_2_to_1(fleet: Fleet, pd: dict[str, engines.Engine], load: Load) -> None:
    assert len(fleet.members["decode"]) == 2, "runs after the scale to two"
    d1 = fleet.members["decode"].pop()
    assert engines.by_source(d1)["external_kv_transfer"] > 0, "the load never reached the second decoder"
    fleet.publish()  # the pod is terminating: not ready, out of the Service's answer
    load.fault()
    dropped = until("the router drops the decoder that left DNS", lambda: fleet.endpoints("decode") == 1)
    took = drained(d1)  # the preStop wait is over: SIGTERM
    print(f"churn: decode 2 -> 1: dropped {dropped:.1f} s after it left DNS; drained and exited in {took:.1f} s")
    print(f"churn: decode 2 -> 1: {load.settle(time.monotonic())}")
    print(f"churn: decode 2 -> 1, {load.check(pd['decode'].url, errors=False)}")


def test_churn_the_prefill_pool_scaled_1_to_0_to_1(
    fleet: Fleet, pd: dict[str, engines.Engine], workdir: Path, model_name: str, load: Load
) -> None:
    old = fleet.members["prefill"].pop()
    fleet.publish()  # no ready prefiller: NXDOMAIN
    load.fault()
    emptied = until("the router empties the prefill pool", lambda: fleet.endpoints("prefill") == 0)
    took = drained(old)
    prompt = text("churn-prefill-zero", LONG_WORDS)
    whole = ask(fleet.router.url(), model_name, True, prompt, False)
    assert (whole.route, whole.reason) == ("fallback", "no_prefiller")
    assert whole.text == colocated(pd["decode"].url, model_name, True, prompt).text
    print(
        f"churn: prefill 1 -> 0: emptied {emptied:.1f} s after NXDOMAIN; drained and exited in {took:.1f} s; "
        "long prompts served whole"
    )
    new = engines.engine("prefill", "dense", 0, workdir, port=old.port, host=old.host)
    pd["prefill"] = new  # the dense pair's prefiller from now on (conftest.Pairs owns it)
    new.start()
    engines.wait_ready([new])
    fleet.members["prefill"].append(new)
    fleet.publish()
    back = disaggregated_again(fleet.router, pd["decode"].url, model_name, "churn-prefill-back")
    print(f"churn: prefill 0 -> 1: disaggregated again {back:.1f} s after the new prefiller was ready")
    print(f"churn: prefill 0 -> 1: {load.settle(time.monotonic())}")
    print(f"churn: prefill 1 -> 0 -> 1, {load.check(pd['decode'].url)}")
