"""Give vLLM's own NIXL agents a progress-thread delay (benchmark fairness on small CPU boxes).

NIXL's Python wrapper hard-codes the progress thread's delay to 0, so every idle agent spins a core; on
a 2-core machine that starves the engines and would make vLLM's connectors look worse than they are.
`kvpush bench-vllm` puts this directory on PYTHONPATH for the nixl-push / nixl-pull servers with
KVPUSH_NIXL_PTHR_DELAY_US set (100 by default, as the baseline measurements used). It wraps the
binding's agent constructor to set the delay; nothing else changes.

The patch is applied lazily, when vLLM itself first imports NIXL's Python API, and only in that process.
An earlier version imported `nixl_cu13._api` here, at interpreter start-up, in every process (API
server, EngineCore, workers): with NixlPushConnector this deadlocked the prefill engine on its first
request (EngineCore waiting for the worker's reply, the worker waiting for the next message, both
idle: see docs/vllm.md), with or without a delay set. Importing NIXL only where vLLM does avoids it.

KVPUSH_NIXL_PROG_THREAD=0 instead turns the progress thread off (diagnostics only).
"""

import importlib.abc
import importlib.util
import os
import sys

_delay = int(os.environ.get("KVPUSH_NIXL_PTHR_DELAY_US", "0") or 0)
_no_prog = os.environ.get("KVPUSH_NIXL_PROG_THREAD", "1") == "0"
_TARGETS = ("nixl_cu13._api", "nixl_cu12._api")


def _patch(mod):
    real = mod.nixlBind

    class _Bind:
        def __getattr__(self, attr):
            return getattr(real, attr)

        def nixlAgent(self, name, cfg):  # noqa: N802 - mirrors the binding's name
            if _no_prog:
                cfg.useProgThread = False
            else:
                cfg.pthrDelay = _delay
            return real.nixlAgent(name, cfg)

    mod.nixlBind = _Bind()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        sys.meta_path.remove(self)  # let the normal machinery find it, then wrap its loader
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


if _delay > 0 or _no_prog:
    sys.meta_path.insert(0, _Finder())
