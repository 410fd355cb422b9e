"""Test stand-in for a prefill whose steps take a real model's time (tests/vllm/test_stream*_vllm.py).

The tiny test model computes a 128-token prefill chunk in about a millisecond on CPU, so a whole prompt can
be computed before the decode engine's registration arrives (its API server and scheduler share the same
two cores); the ranges then leave as one WRITE and the streamed path is not exercised. A real model's
chunk takes tens of milliseconds on any accelerator. With KVPUSH_TEST_PREFILL_STEP_S=seconds on this
directory's PYTHONPATH, the prefill engine's kvpush worker sleeps that long at the end of every step that
computed prompt KV, on the engine's own thread, as a longer forward pass would. Applied lazily, when
vLLM imports the connector's prefill worker, and only in that process; nothing else changes.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_STEP_S = float(os.environ.get("KVPUSH_TEST_PREFILL_STEP_S", "0") or 0)
_MODULE = "kvpush.platforms.vllm.prefill_worker"


def _patch(mod):
    real = mod.PrefillWorker.end_step

    def end_step(self, meta):
        computed = bool(meta.ready or meta.send or self._layered)  # a step that computed prompt KV
        real(self, meta)
        if computed:
            time.sleep(_STEP_S)

    mod.PrefillWorker.end_step = end_step


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
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)  # the normal machinery finds it; its loader is wrapped
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


if _STEP_S > 0:
    sys.meta_path.insert(0, _Finder())
