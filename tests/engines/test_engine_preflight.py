"""The engine preflight (charts/pd-inference/files/preflight.py) with the real NIXL and LMCache of
the engine stack, run with the arguments the chart renders. A stand-in engine (the interpreter
running a one-liner) replaces `vllm serve`, so a passing preflight is seen to exec it."""

from __future__ import annotations

import ctypes.util
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import cases, helm
from tests.cases import LMCACHE
from tests.engines import stack
from tests.manifests import lmcache_config

# One worker runs the whole module: its real-stack harness runs once, cached (pytest-xdist loadgroup).
pytestmark = pytest.mark.xdist_group("engine-preflight")

ENGINE = "ENGINE STARTED"
PREFIX = "pd-inference preflight: "
VLLM = stack.VLLM_VERSIONS[0]  # the version the engine image carries
NIXL, LMCACHE_VERSION = stack.checked("nixl")[0], stack.checked("lmcache")[0]


def rendered_command(files: tuple[str, ...] = (), sets: tuple[str, ...] = (), role: str = "decode") -> list[str]:
    """The preflight's own arguments as the chart renders them (before `-- vllm serve`)."""
    docs = helm.render(helm.helm_binaries()[0], files, sets)
    command = helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[1] == "/etc/pd-inference/preflight.py" and command[-3:] == ["--", "vllm", "serve"]
    return command[2:-3]


def lmcache_yaml(role: str = "decode", **changes: object) -> str:
    cfg = lmcache_config(helm.render(helm.helm_binaries()[0], (LMCACHE,)), role)
    cfg.update(changes)
    return yaml.safe_dump({k: v for k, v in cfg.items() if v is not None})


def preflight(
    args: list[str],
    tmp_path: Path,
    config: str | None = None,
    python: Path | None = None,
    vllm: str | None = VLLM,
    shim: dict[str, str] | None = None,
    engine: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`shim`: modules (dotted name -> source) put ahead of the real ones, as a broken image would have them."""
    env = {**stack.env(vllm), **(extra_env or {})}
    if config is not None:
        (tmp_path / "lmcache.yaml").write_text(config)
        env["LMCACHE_CONFIG_FILE"] = str(tmp_path / "lmcache.yaml")
    if shim:
        for name, source in shim.items():
            path = tmp_path / "shim" / Path(*name.split(".")).with_suffix(".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
            for parent in path.parents:
                if parent == tmp_path / "shim":
                    break
                (parent / "__init__.py").touch()
        env["PYTHONPATH"] = ":".join(p for p in (str(tmp_path / "shim"), env.get("PYTHONPATH", "")) if p)
    exe = str(python or stack.python())
    return subprocess.run(
        [exe, str(stack.PREFLIGHT), *args, "--", *(engine or [exe, "-c", f"print({ENGINE!r})"])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def failure_line(proc: subprocess.CompletedProcess[str]) -> str:
    """A failed preflight says one line, and the engine never starts."""
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert ENGINE not in proc.stdout
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(PREFIX + "FAILED: ")
    return lines[0].removeprefix(PREFIX + "FAILED: ")


def test_ucx_passes_and_execs_the_engine(tmp_path: Path) -> None:
    args = rendered_command()  # chart defaults: NixlConnector over UCX, no EFA
    assert {"--backend=UCX", "--connector=nixl", "--buffer-device=cuda"} <= set(args)
    proc = preflight(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ENGINE  # exec'd: the engine's output is all that follows
    assert proc.stderr.strip() == f"{PREFIX}ok (connector=nixl, backend=UCX, nixl {NIXL}, vllm {VLLM})"


@pytest.mark.skipif(
    ctypes.util.find_library("fabric") is not None, reason="this machine has libfabric: the LIBFABRIC plugin may load"
)
def test_libfabric_without_libfabric_names_the_value_and_the_missing_library(tmp_path: Path) -> None:
    args = rendered_command(sets=("kvTransfer.backend=LIBFABRIC",))
    line = failure_line(preflight(args, tmp_path))
    # This machine has no libfabric (nor hwloc, nor a GPU driver): NIXL's LIBFABRIC plugin cannot load.
    assert line.startswith("kvTransfer.backend resolves to LIBFABRIC, but the image's NIXL cannot create it: ")
    assert line.endswith(" not found")
    assert "libfabric.so.1" in line and "libhwloc.so.15" in line


def test_efa_on_without_efa_devices(tmp_path: Path) -> None:
    args = rendered_command(("values/profiles/qwen3.5-9b-g6.yaml",))
    assert {"--efa-devices=1", "--backend=LIBFABRIC", "--buffer-device=cpu"} <= set(args)
    line = failure_line(preflight(args, tmp_path))
    assert line.startswith("efa.enabled is true, but no EFA device is visible in the pod")


def test_lmcache_passes_with_the_rendered_config(tmp_path: Path) -> None:
    for role in ("prefill", "decode"):
        args = rendered_command((LMCACHE,), role=role)
        assert "--buffer-field=kvTransfer.lmcache.bufferDevice" in args
        proc = preflight(args, tmp_path, lmcache_yaml(role))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == ENGINE
        assert "connector=lmcache" in proc.stderr and f"lmcache {LMCACHE_VERSION}" in proc.stderr


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"enable_nixl": True}, f"kvTransfer.lmcache.extraConfig: LMCache {LMCACHE_VERSION} does not know enable_nixl"),
        # Without it LMCache overrides the value and warns: the preflight refuses a config LMCache changes.
        ({"save_unfull_chunk": None}, "kvTransfer.lmcache: LMCache changed or ignored the rendered config"),
    ],
)
def test_lmcache_config_the_image_would_not_run_as_rendered(tmp_path: Path, changes: dict, expected: str) -> None:
    proc = preflight(rendered_command((LMCACHE,)), tmp_path, lmcache_yaml(**changes))
    assert failure_line(proc).startswith(expected)


def test_lmcache_config_file_missing(tmp_path: Path) -> None:
    line = failure_line(preflight(rendered_command((LMCACHE,)), tmp_path))
    assert line.startswith("kvTransfer.connector=lmcache: LMCACHE_CONFIG_FILE")


def test_an_image_without_nixl(tmp_path: Path) -> None:
    missing = {"nixl": "raise ImportError(\"No module named 'nixl'\")"}
    line = failure_line(preflight(rendered_command(), tmp_path, shim=missing))
    assert line.startswith("kvTransfer.backend needs NIXL, but the engine image cannot import it")


def test_a_python_without_vllm_is_not_the_engines(tmp_path: Path) -> None:
    """engine.preflight.python pointing at another interpreter: every check would look at the wrong packages."""
    line = failure_line(preflight(rendered_command(), tmp_path, vllm=None))
    assert line.startswith("engine.preflight.python: ") and "has no vllm package" in line


def test_a_vllm_that_runs_in_another_interpreter(tmp_path: Path) -> None:
    vllm = tmp_path / "bin" / "vllm"
    vllm.parent.mkdir()
    vllm.write_text("#!/usr/bin/python3\nprint('the other interpreter')\n")
    vllm.chmod(0o755)
    line = failure_line(preflight(rendered_command(), tmp_path, engine=[str(vllm), "serve"]))
    assert (
        line
        == f"engine.preflight.python: {vllm} runs in /usr/bin/python3, not in {stack.python()}; set it to /usr/bin/python3"
    )


def test_an_engine_command_that_is_not_there(tmp_path: Path) -> None:
    line = failure_line(preflight(rendered_command(), tmp_path, engine=["no-such-vllm", "serve"]))
    assert line == "the engine command 'no-such-vllm' is not on PATH in this image (engine.image)"


def test_a_nixl_that_crashes_is_reported_in_one_line(tmp_path: Path) -> None:
    crash = {"nixl._api": "import ctypes\nprint('NIXL about to crash', flush=True)\nctypes.string_at(0)\n"}
    line = failure_line(preflight(rendered_command(), tmp_path, shim=crash))
    assert line == "the NIXL/LMCache checks crashed (signal SIGSEGV, backend UCX); last output: NIXL about to crash"


def test_a_nixl_that_hangs_is_reported_after_the_deadline(tmp_path: Path) -> None:
    # torch shimmed too: the deadline starts before the checks import it, and the real wheel's
    # import can take most of 5 s on a busy 2-core machine
    hang = {"torch": "", "nixl._api": "import time\nprint('NIXL waiting for a device', flush=True)\ntime.sleep(3600)\n"}
    args = [a if not a.startswith("--timeout-seconds=") else "--timeout-seconds=5" for a in rendered_command()]
    line = failure_line(preflight(args, tmp_path, shim=hang))
    assert (
        line
        == "the NIXL/LMCache checks did not finish within 5 s (backend UCX); last output: NIXL waiting for a device"
    )


def test_a_vllm_the_chart_was_not_checked_against_is_named(tmp_path: Path) -> None:
    other = stack.VLLM_VERSIONS[-1]
    args = [a if not a.startswith("--checked-vllm=") else f"--checked-vllm={other}" for a in rendered_command()]
    proc = preflight(args, tmp_path, vllm=VLLM)
    assert proc.returncode == 0 and proc.stdout.strip() == ENGINE
    assert f"WARNING: the chart was checked against vLLM {other}, not {VLLM}" in proc.stderr


LORA_COMMIT = "4" * 40
LORA_SETS = (
    "model.lora.adapters[0].name=support-bot",
    "model.lora.adapters[0].rank=8",
    "model.lora.adapters[0].hub.id=acme/support-lora",
    f"model.lora.adapters[0].hub.revision={LORA_COMMIT}",
)


def _hub_env(tmp_path: Path) -> dict[str, str]:
    """An offline hub cache in ``tmp_path``: huggingface_hub (the engine stack's) resolves a
    pinned commit from the cache alone, as it does in a pod whose model volume holds it."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}


def test_a_hub_adapter_at_its_commit_is_fetched_before_the_engine_starts(tmp_path: Path) -> None:
    args = rendered_command(sets=LORA_SETS)
    assert f"--lora-hub=model.lora.adapters[0].hub=acme/support-lora@{LORA_COMMIT}" in args
    # the folder the chart gives vLLM (engine/_args.tpl pd-inference.loraPath), present offline
    snap = tmp_path / "hf" / "hub" / "models--acme--support-lora" / "snapshots" / LORA_COMMIT
    snap.mkdir(parents=True)
    (snap / "adapter_config.json").write_text("{}")
    proc = preflight(args, tmp_path, extra_env=_hub_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ENGINE
    assert "lora adapters=1" in proc.stderr


def test_a_hub_adapter_that_cannot_be_fetched_names_its_field(tmp_path: Path) -> None:
    args = rendered_command(sets=LORA_SETS)
    line = failure_line(preflight(args, tmp_path, extra_env=_hub_env(tmp_path)))
    assert line.startswith(f"model.lora.adapters[0].hub: cannot download acme/support-lora at {LORA_COMMIT}"), line


def test_lmcache_mp_connector_is_imported_before_the_engine_starts(tmp_path: Path) -> None:
    """kvTransfer.nixl.lmcacheMp: the preflight imports LMCache's MP connector as vLLM will;
    negative control: an image whose LMCache lacks it fails in one line naming the field."""
    args = rendered_command(cases.LAYERINGS["scenario:lmcache-mp+dev"], ("efa.enabled=false",))
    assert "--lmcache-mp" in args
    proc = preflight(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f", lmcache-mp {stack.checked('lmcache')[0]}, " in proc.stderr, proc.stderr
    broken = {"lmcache.integration.vllm.lmcache_mp_connector": "raise ImportError('no MP connector in this build')"}
    line = failure_line(preflight(args, tmp_path, shim=broken))
    assert line.startswith("kvTransfer.nixl.lmcacheMp.enabled needs LMCache's MP connector"), line
