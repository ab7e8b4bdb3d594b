"""Shared fixtures: real engine/router processes on loopback, stopped at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_router_dev.devstack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(tmp_path_factory.mktemp("stack"))
    try:
        yield st
    finally:
        st.stop()
