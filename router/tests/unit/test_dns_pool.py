"""DNS discovery's answers (pd_router.discovery.EndpointPool.discover_once): the set follows the
headless Service's answer; a name that stops existing (NXDOMAIN: no ready endpoint, a pool
scaled to zero) empties the pool at the second answer in a row; any other failed lookup keeps the
last set. The resolver is asyncio's ``getaddrinfo``, answered here by a table."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pd_router import discovery
from pd_router.config import Dns, Health, Pool

NAME = "pd-decode.ns.svc.cluster.local"
PORT = 8000


def endpoints_after(
    answers: list[list[str] | int], monkeypatch: pytest.MonkeyPatch
) -> list[list[str]]:
    """A DNS pool's endpoints after each lookup, the lookups answering ``answers`` in turn:
    addresses, or a getaddrinfo error."""
    pool = discovery.EndpointPool(
        "decode", Pool(discovery="dns", dns=Dns(name=NAME, port=PORT)), Health()
    )
    it = iter(answers)

    async def getaddrinfo(host: str, port: int, **_: object) -> list[tuple]:
        assert (host, port) == (NAME, PORT)
        got = next(it)
        if isinstance(got, int):
            raise socket.gaierror(got, "lookup failed")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in got]

    async def check_all(eps: list[discovery.Endpoint] | None = None) -> None:
        return None  # health checks are not this test's business

    monkeypatch.setattr(pool, "check_all", check_all)

    async def go() -> list[list[str]]:
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
        seen = []
        for _ in answers:
            await pool.discover_once()
            seen.append(sorted(pool.endpoints))
        return seen

    return asyncio.run(go())


A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def test_the_set_follows_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[list[str] | int] = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]]
    assert endpoints_after(answers, monkeypatch) == [[A], [A, B], [B]]


def test_nxdomain_twice_in_a_row_empties_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    nx = socket.EAI_NONAME
    answers: list[list[str] | int] = [["10.0.0.1"], nx, ["10.0.0.1"], nx, nx, nx, ["10.0.0.2"]]
    # one stray NXDOMAIN keeps the set; two in a row empty it; the next address fills it again
    assert endpoints_after(answers, monkeypatch) == [[A], [A], [A], [A], [], [], [B]]


def test_other_lookup_failures_keep_the_last_set(monkeypatch: pytest.MonkeyPatch) -> None:
    again = socket.EAI_AGAIN  # SERVFAIL, or no answer in time
    nx = socket.EAI_NONAME
    answers: list[list[str] | int] = [["10.0.0.1"], again, again, nx, again, nx, again]
    # a failure that is not NXDOMAIN neither empties the pool nor lets two NXDOMAINs it
    # separates count as in a row
    assert endpoints_after(answers, monkeypatch) == [[A]] * 7
