"""What kvpush answers to the questions vLLM asks the connector class before any engine exists.

vLLM's config process imports the connector class and calls its classmethods while it resolves the
configuration (0.32+: whether CUDA graphs must be piecewise; 0.33+: whether sleep mode is allowed; 0.34+:
how the workers reach the device KV cache, which decides how the extensible KV cache is allocated). The
answers are decided here from the KV transfer config alone, so that they import neither NIXL nor torch's
CUDA state, and so that one class answers on every vLLM: vLLM's own `KVCacheAccess` flags where the
installed vLLM defines them, an identical stand-in where it does not (nothing calls it there).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

try:  # vLLM >= 0.34
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined,unused-ignore]
except ImportError:  # older vLLM (or none): the same flags, so callers and tests need no version checks

    class KVCacheAccess(enum.IntFlag):  # type: ignore[no-redef]
        """How a connector reaches the device KV cache (vLLM 0.34's flags, same names and values)."""

        IN_PROCESS = 0
        REGISTERS = enum.auto()
        EXPORTS_FD = enum.auto()
        EXPORTS_FABRIC = enum.auto()
        LEGACY_IPC = enum.auto()


__all__ = ["SUPPORTS_SLEEP_MODE", "KVCacheAccess", "kv_cache_access", "layer_hooks_carry_work"]

# A sleeping engine frees (0.33+: remaps) its KV memory while kvpush's NIXL registrations, and the
# prefills' WRITEs aimed at them, still point there; kvpush does not unregister and restore, so vLLM must
# refuse `--enable-sleep-mode` with this connector instead of letting a push write into freed memory.
SUPPORTS_SLEEP_MODE = False


def kv_cache_access(kv_buffer_device: str | None) -> KVCacheAccess:
    """The access flags for vLLM's `kv_buffer_device` (the one setting that picks kvpush's memory
    backend, kvpush.backends.select): "cpu" means host staging, where the device KV cache is only read and
    written by copies in the engine's own process (NIXL registers the host bounce buffer, or host KV
    tensors): IN_PROCESS. Anything else means device memory registered with NIXL (VRAM): REGISTERS, which
    needs one physical allocation per registered segment, plus EXPORTS_FABRIC, because a prefill and a
    decode on one host reach each other's device memory through UCX's CUDA IPC, which needs the
    extensible cache's pages exported as fabric handles (vLLM leaves the extensible cache off by
    default where no IMEX channel exists, keeping NVLink for transfers within a host)."""
    if str(kv_buffer_device or "cpu").lower() == "cpu":
        return KVCacheAccess.IN_PROCESS
    return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC


def layer_hooks_carry_work(extra_config: Mapping[str, Any] | None) -> bool:
    """Whether `save_kv_layer` pushes anything with this kv_connector_extra_config: only with
    `stream_layers` > 0 (a prefill reports every N layers as the attention layers write them). Full CUDA
    graph replay skips the layer hooks, so then vLLM must run piecewise graphs. A malformed value is left
    to ConnectorSettings, which refuses it by name when the connector is built."""
    value = (extra_config or {}).get("stream_layers", 0)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
