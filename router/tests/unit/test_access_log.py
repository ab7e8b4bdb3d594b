"""The per-request line written without the logging machinery has the shape JsonFormatter
gives every other record, and is off unless the router logs at info."""

from __future__ import annotations

import json
import logging

from pd_router.logs import AccessLog, JsonFormatter


def test_the_access_line_is_what_the_json_formatter_writes(tmp_path) -> None:
    logger = logging.getLogger("pd_router.test_access")
    logger.setLevel(logging.INFO)
    out = tmp_path / "out.log"
    with open(out, "w") as f:
        access = AccessLog(logger, f)
        assert access.enabled
        access.write(
            "rid-1",
            "direct",
            "prefix_cached",
            200,
            "/v1/completions",
            1.25,
            "0a1b2c3d",
            "4bf92f35",
            "http://10.0.0.7:8000",
            "http://10.0.0.8:8000",
        )
    line = json.loads(out.read_text())
    record = logging.LogRecord("pd_router", logging.INFO, __file__, 1, "request", None, None)
    for k, v in {
        "request_id": "rid-1",
        "route": "direct",
        "reason": "prefix_cached",
        "status": 200,
        "path": "/v1/completions",
        "duration_ms": 1.25,
        "kv_revision": "0a1b2c3d",
        "trace_id": "4bf92f35",
        "engine": "http://10.0.0.7:8000",
        "prefiller": "http://10.0.0.8:8000",
    }.items():
        setattr(record, k, v)
    expected = json.loads(JsonFormatter().format(record))
    assert line.keys() == expected.keys()
    assert {k: v for k, v in line.items() if k != "ts"} == {
        k: v for k, v in expected.items() if k != "ts"
    }
    assert line["ts"].endswith("Z") and len(line["ts"]) == len(expected["ts"])


def test_the_access_line_is_off_above_info() -> None:
    logger = logging.getLogger("pd_router.test_access_quiet")
    logger.setLevel(logging.WARNING)
    assert not AccessLog(logger).enabled
