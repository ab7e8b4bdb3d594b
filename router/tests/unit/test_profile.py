"""``make bench``'s profile section charges py-spy's samples to owners by their innermost frame
(the raw lines below are py-spy 0.4.3's ``--format raw --subprocesses`` output, shortened)."""

from __future__ import annotations

from pd_router_dev import profile

ROOT = 'process 7:"python -m pd_router serve --config /tmp/r.yaml"'
LOOP = "Runner.run (asyncio/runners.py:118)"
ROUTE = "Router._route (pd_router/app.py:494)"
RAW = "\n".join(
    (
        f"{ROOT};{LOOP};HttpConnection.data_received (pd_router/http1.py:410) 6",
        f"{ROOT};{ROUTE};UpstreamClient._send (pd_router/upstream.py:390) 3",
        f"{ROOT};{ROUTE};UpstreamClient._send (pd_router/upstream.py:392) 1",
        f"{ROOT};{ROUTE};Decider.decide (pd_router/decide.py:127) 4",
        f"{ROOT};{ROUTE};Counter.inc (prometheus_client/metrics.py:310) 2",
        f"{ROOT};{LOOP} 3",
        f"{ROOT} 1",
        "",
    )
)


def test_samples_are_charged_to_the_innermost_frames_owner() -> None:
    by_owner, by_func = profile.charge(RAW)
    assert by_owner == {
        "our HTTP server (pd_router/http1.py)": 6,
        "upstream client (pd_router/upstream.py)": 4,
        "our handler chain (pd_router, the rest)": 4,
        "metrics (prometheus_client, pd_router/metrics.py)": 2,
        "event loop, transports and syscalls (asyncio, uvloop)": 3,
        profile.NO_FRAME: 1,
    }
    # one function's lines are one entry
    assert by_func["UpstreamClient._send (pd_router/upstream.py)"] == 4


def test_the_table_gives_each_owners_share_per_route() -> None:
    rows = profile.rows("ours-direct", "direct route", RAW)
    lines = profile.table(rows)
    assert "| our HTTP server (pd_router/http1.py) | 30 % |" in lines
    assert any("`HttpConnection.data_received (pd_router/http1.py)` 30 %" in line for line in lines)
    assert profile.table([]) == []


def test_samples_are_charged_to_the_step_of_their_innermost_frame_that_has_one() -> None:
    steps = profile.by_step(RAW)
    assert steps == {
        "HTTP server: reading requests, writing answers": 6,
        "upstream client: the engine call": 4,
        "decision: prompt bound, prefix index, engine choice": 4,
        "counting: metrics and the request's outcome": 2,
        "event loop and transports (asyncio, uvloop)": 3,
        profile.NO_FRAME: 1,
    }
    # the route's own frame where nothing inside it has a step; C code under a step is its
    assert profile.step([ROOT, LOOP, ROUTE]) == "request setup, routing and finishing (app.py, Ctx)"
    parse = "Router._parse (pd_router/app.py:440)"
    assert profile.step([ROOT, ROUTE, parse]) == "body parse and validation"
    assert profile.step([ROOT, "f (somewhere/else.py:1)"]) == "other"


def test_the_step_table_gives_each_steps_cpu_per_request() -> None:
    rows = profile.rows("ours-direct", "direct route", RAW, cpu_per_request=100e-6)
    lines = profile.step_table(rows, ["direct route"])
    assert "| step | direct route (100 µs) |" in lines
    assert "| HTTP server: reading requests, writing answers | 30.0 (30 %) |" in lines
    assert profile.step_table([], ["direct route"]) == []
