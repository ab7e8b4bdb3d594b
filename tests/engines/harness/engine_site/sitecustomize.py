"""Imported by every Python process of a real-engine test (this folder is on PYTHONPATH): NIXL
1.5.1's Python API starts its UCX progress thread with a poll delay of 0 (``nixl_agent.__init__``
sets ``agent_config.pthrDelay = 0``), so the thread spins a whole core even when idle and two
engines fill a 2-core machine. A delay of PTHR_DELAY_US (the thread's poll timeout; UCX events
still wake it at once) brings an idle engine down to a few per cent of a core
(../shared/design/real-engine-cpu.md). Applied when the NIXL bindings are first imported."""

import importlib.abc
import importlib.machinery
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
