"""Imported by every Python process of a real-engine test (this folder is on PYTHONPATH). Two
changes, each applied when the module it patches is first imported (:class:`_OnImport`):

- NIXL 1.5.1's Python API starts its UCX progress thread with a poll delay of 0
  (``nixl_agent.__init__`` sets ``agent_config.pthrDelay = 0``), so the thread spins a whole
  core even when idle and two engines fill a 2-core machine. A delay of PTHR_DELAY_US (the
  thread's poll timeout; UCX events still wake it at once) brings an idle engine down to a few
  per cent of a core (../shared/design/real-engine-cpu.md).
- vLLM 0.31's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn (CpuPlatform.
  check_and_update_config, platforms/cpu.py:392), so its engine core and its worker each start
  a fresh interpreter that imports torch and vLLM again: about 10 s each on one pinned core, 20
  of an engine's 38 s start (2026-12-06). vLLM's default is fork (envs.py), what a GPU pod uses
  unless CUDA is initialised first (utils/system_utils.py _maybe_force_spawn); the tier forks
  too, and an engine is ready in about 18 s.
- llvmlite's ``ffi.lib`` (``_lib_wrapper``, imported through numba by LMCache 0.5.6's MP
  connector: lmcache/v1/multiprocess/token_hasher.py) answers any attribute, ``__dict__``
  included, with a wrapped C function, and vLLM 0.31's CPU platform scans every module's
  attributes at worker start calling ``vars(value).get("kernel")`` on each that has a
  ``__dict__`` (triton_utils/dispatcher.py ``_rebind_kernels``, from platforms/cpu.py): the worker
  died with "'_lib_fn_wrapper' object has no attribute 'get'". Dunder names are refused instead
  (a C library exports none), so the scan passes it by. CPU-only: vLLM's GPU platforms do not
  scan."""

import importlib.abc
import importlib.machinery
import os
import sys

PTHR_DELAY_US = 1000


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after any of ``names`` is first imported."""

    def __init__(self, names, patch):
        self.names, self.patch = names, patch

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _slow_nixl_progress_thread(module):
    agent = module.nixlAgent

    class nixlAgent(agent):  # noqa: N801 - the binding's own name
        def __init__(self, name, config):
            config.pthrDelay = PTHR_DELAY_US
            super().__init__(name, config)

    module.nixlAgent = nixlAgent


def _fork_engine_processes(module):
    platform = module.CpuPlatform
    real = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        real(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_and_update_config)


def _llvmlite_lib_without_dunders(module):
    cls = module._lib_wrapper
    real = cls.__getattr__

    def __getattr__(self, name):  # noqa: N807 - the protocol's name
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return real(self, name)

    cls.__getattr__ = __getattr__


sys.meta_path.insert(0, _OnImport(("nixl_cu13._bindings", "nixl_cu12._bindings"), _slow_nixl_progress_thread))
sys.meta_path.insert(0, _OnImport(("llvmlite.binding.ffi",), _llvmlite_lib_without_dunders))
sys.meta_path.insert(0, _OnImport(("vllm.platforms.cpu",), _fork_engine_processes))
