"""Benchmark-fairness patches for vLLM's own NIXL connectors on small CPU boxes.

`kvpush bench-vllm` and `kvpush serve-pd` put this directory on PYTHONPATH for the nixl-push / nixl-pull
servers. Two patches, each switched on by its own environment variable and applied lazily, when vLLM
itself first imports the patched module, and only in that process (an earlier version imported NIXL at
interpreter start-up in every process, which deadlocked NixlPushConnector's prefill engine):

- KVPUSH_NIXL_PTHR_DELAY_US=N: NIXL's Python wrapper hard-codes the progress thread's delay to 0, so
  every idle agent spins a core; on a 2-core machine that starves the engines and would make vLLM's
  connectors look worse than they are. The patch wraps the binding's agent constructor to set the delay.
  KVPUSH_NIXL_PROG_THREAD=0 turns the progress thread off instead (diagnostics only).
- KVPUSH_VLLM_NO_KV_CORE_PIN=1: on CPU, vLLM's NIXL worker pins the worker's main thread to the last
  core of each NUMA node (meant to keep transfer work off the compute cores of a big box). On a box
  where each engine owns one core (VLLM_CPU_OMP_THREADS_BIND) that moves the prefill engine's compute
  thread onto the decode engine's core. The patch makes CpuPlatform.discover_numa_topology report no
  cores to reserve, so each engine keeps the core it was given.
"""

import importlib.abc
import importlib.util
import os
import sys

_delay = int(os.environ.get("KVPUSH_NIXL_PTHR_DELAY_US", "0") or 0)
_no_prog = os.environ.get("KVPUSH_NIXL_PROG_THREAD", "1") == "0"
_no_pin = os.environ.get("KVPUSH_VLLM_NO_KV_CORE_PIN", "0") == "1"


def _patch_nixl(mod):
    real = mod.nixlBind

    class _Bind:
        def __getattr__(self, attr):
            return getattr(real, attr)

        def nixlAgent(self, name, cfg):
            if _no_prog:
                cfg.useProgThread = False
            else:
                cfg.pthrDelay = _delay
            return real.nixlAgent(name, cfg)

    mod.nixlBind = _Bind()


def _patch_cpu_platform(mod):
    def _no_reserved_cores(cls):
        return []

    mod.CpuPlatform.discover_numa_topology = classmethod(_no_reserved_cores)


_PATCHES = {}
if _delay > 0 or _no_prog:
    _PATCHES.update({"nixl_cu13._api": _patch_nixl, "nixl_cu12._api": _patch_nixl})
if _no_pin:
    _PATCHES["vllm.platforms.cpu"] = _patch_cpu_platform


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # let the normal machinery find it, then wrap its loader
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _Finder())
