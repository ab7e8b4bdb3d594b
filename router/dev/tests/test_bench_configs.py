"""Every router config ``make bench`` writes for the goodput decision's rows is one the router
accepts (a row whose router refuses its config stops the whole bench)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_router.config import ConfigError, load_config
from pd_router_dev import bench


def test_the_goodput_rows_configs_are_accepted(tmp_path: Path) -> None:
    pre, dec = "http://127.0.0.1:18001", "http://127.0.0.1:18002"
    layouts = set()
    for key, _, over in bench.goodput_overrides(pre, dec):
        cfg = load_config(bench._router_config(tmp_path, key, over, 1, "warning"))
        assert cfg.routing.decision == "goodput"
        layouts.add(cfg.pools.layout)
    assert layouts == {"split", "flexible"}


def test_an_override_set_to_none_removes_the_key(tmp_path: Path) -> None:
    """Negative control for the flexible row: the demo config's ``pools.prefill`` left in is
    refused with the flexible layout, naming the field."""
    _, _, over = bench.goodput_overrides("http://127.0.0.1:18001", "http://127.0.0.1:18002")[1]
    kept = {**over, "pools": {k: v for k, v in over["pools"].items() if v is not None}}
    with pytest.raises(ConfigError, match=r"pools\.prefill"):
        load_config(bench._router_config(tmp_path, "kept", kept, 1, "warning"))
