"""Give vLLM's own NIXL agents a progress-thread delay (benchmark fairness on small CPU boxes).

NIXL's Python wrapper hard-codes the progress thread's delay to 0, so every idle agent spins a core; on
a 2-core machine that starves the engines and would make vLLM's connectors look worse than they are.
`kvpush bench-vllm` puts this directory on PYTHONPATH for the nixl-push / nixl-pull servers with
KVPUSH_NIXL_PTHR_DELAY_US set (100 by default, as the baseline measurements used). It wraps the
binding's agent constructor to set the delay; nothing else changes.
"""

import importlib
import os

_delay = int(os.environ.get("KVPUSH_NIXL_PTHR_DELAY_US", "0") or 0)
if _delay > 0:
    for _name in ("nixl_cu13._api", "nixl_cu12._api"):
        try:
            _mod = importlib.import_module(_name)
        except Exception:  # noqa: BLE001 - a missing flavour is fine
            continue
        _real = _mod.nixlBind

        class _Bind:
            def __getattr__(self, attr, _real=_real):
                return getattr(_real, attr)

            def nixlAgent(self, name, cfg, _real=_real):  # noqa: N802 - mirrors the binding's name
                cfg.pthrDelay = _delay
                return _real.nixlAgent(name, cfg)

        _mod.nixlBind = _Bind()
        break
