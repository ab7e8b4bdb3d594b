"""Imported by every Python process of a real-engine test (this folder is on PYTHONPATH). Two
changes, each applied when the module it patches is first imported.

NIXL
1.5.1's Python API starts its UCX progress thread with a poll delay of 0 (``nixl_agent.__init__``
sets ``agent_config.pthrDelay = 0``), so the thread spins a whole core even when idle and two
engines fill a 2-core machine. A delay of PTHR_DELAY_US (the thread's poll timeout; UCX events
still wake it at once) brings an idle engine down to a few per cent of a core
(../shared/design/real-engine-cpu.md).

vLLM's engine core and worker processes are forked, as vLLM does by default, instead of spawned
as its CPU platform forces: an engine is ready in about 18 s instead of 38 (below)."""

import importlib.abc
import importlib.machinery
import os
import sys

PTHR_DELAY_US = 1000
_BINDINGS = ("nixl_cu13._bindings", "nixl_cu12._bindings")


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _BINDINGS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            agent = module.nixlAgent

            class nixlAgent(agent):  # noqa: N801 - the binding's own name
                def __init__(self, name, config):
                    config.pthrDelay = PTHR_DELAY_US
                    super().__init__(name, config)

            module.nixlAgent = nixlAgent

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())


# vLLM 0.31's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn (CpuPlatform.
# check_and_update_config, platforms/cpu.py:392), so its engine core and its worker each start
# a fresh interpreter that imports torch and vLLM again: about 10 s each on one pinned core, 20
# of an engine's 38 s start (2026-12-06). vLLM's default is fork (envs.py), what a GPU pod uses
# unless CUDA is initialised first (utils/system_utils.py _maybe_force_spawn); the tier forks too.
_CPU_PLATFORM = "vllm.platforms.cpu"


class _Fork(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _CPU_PLATFORM:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            platform = module.CpuPlatform
            real = platform.check_and_update_config.__func__

            def check_and_update_config(cls, vllm_config):
                real(cls, vllm_config)
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

            platform.check_and_update_config = classmethod(check_and_update_config)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Fork())
