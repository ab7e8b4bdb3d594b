"""pd_router.adapters: which names a router serves, which engines may take an adapter's request,
and which prefiller may hand its KV to which decoder for one."""

from __future__ import annotations

import pytest

from pd_router.adapters import Names, Wanted, both, listed, same_adapter
from pd_router.discovery import Endpoint

SERVED = "llama"
REV = "0123456789"


def engine(name: str, revision: str = "", **adapters: str) -> Endpoint:
    ep = Endpoint(f"http://{name}:8000")
    ep.revision = revision
    ep.adapters = dict(adapters)
    return ep


def test_names_served_and_their_engines() -> None:
    names = Names(SERVED, ["sql", "bot"])
    assert names.wanted(None) is None and names.wanted(SERVED) is None  # any engine
    assert names.wanted("sql") == Wanted(adapter="sql")
    assert names.wanted(f"{SERVED}@kv-{REV}") == Wanted(revision=REV)
    for other in ("nope", f"{SERVED}@kv-zz", f"other@kv-{REV}", 7, ["sql"]):
        with pytest.raises(KeyError):
            names.wanted(other)
    # the metric label: the served name or a configured adapter, never the client's string
    assert [names.label(m) for m in ("sql", None, f"{SERVED}@kv-{REV}", "nope")] == [
        "sql",
        SERVED,
        SERVED,
        SERVED,
    ]


def test_an_adapters_engines_list_it_and_a_revisions_are_of_it() -> None:
    a, b, c = engine("a", sql="/m/sql"), engine("b", REV), engine("c", REV, sql="/m/sql")
    assert Wanted(adapter="sql").engines([a, b, c]) == [a, c]
    assert Wanted(revision=REV).engines([a, b, c]) == [b, c]
    assert Wanted(adapter="sql", revision=REV).engines([a, b, c]) == [c]


def test_listed_reads_the_adapters_of_the_served_model_with_their_paths() -> None:
    answer = {
        "data": [
            {"id": SERVED, "parent": None, "root": "/models/llama"},
            {"id": f"{SERVED}@kv-{REV}", "parent": None},
            {"id": "sql", "parent": SERVED, "root": "/m/sql"},
            {"id": "elsewhere", "parent": "other-model", "root": "/m/x"},
        ]
    }
    assert listed(answer, SERVED) == {"sql": "/m/sql"}
    assert listed({"detail": "Not Found"}, SERVED) == {}


def test_only_one_version_of_an_adapter_is_paired() -> None:
    same = same_adapter("sql")
    p_v1, p_v2 = engine("p1", sql="/m/sql@1"), engine("p2", sql="/m/sql@2")
    d = engine("d", sql="/m/sql@1")
    assert same(p_v1, d) and not same(p_v2, d)
    quarantined = both(lambda p, dec: p is not p_v1, same)
    assert not quarantined(p_v1, d) and not quarantined(p_v2, d)
    assert both(None, same) is same
