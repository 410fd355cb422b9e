"""The one place that picks a memory backend for an engine's KV tensors.

The choice is never a default: it follows from the KV tensors' device and vLLM's `kv_buffer_device`, and
an impossible pair is refused with the reason (`select_backend`). It lives apart from base.py because it
imports every backend, and every backend imports base.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.errors import ConfigError
from kvpush.protocol.layout import KVLayout

from .base import KVCache
from .cuda import CudaKVCache
from .host import HostKVCache
from .neuron import NeuronKVCache
from .staging import HostStaging


@dataclass(frozen=True)
class BackendChoice:
    """Which backend serves a cache, the memory NIXL registers, whether host staging is used, and why."""

    backend: str  # "host", "cuda", "neuron"
    mem_type: str  # what NIXL registers: "DRAM" when staged or host
    staged: bool
    reason: str


NEURON_DEVICE_TYPES = ("neuron", "privateuseone")  # torch-neuronx renames PrivateUse1; both occur


def select_backend(device_type: str, kv_buffer_device: str, force_staging: bool = False) -> BackendChoice:
    """The backend for KV tensors on `device_type` with vLLM's `kv_buffer_device`.

    vLLM's convention: kv_buffer_device "cuda" means "register device memory as VRAM", "cpu" means
    "a host buffer". vllm-neuron uses "cuda" for Neuron HBM ("cuda" there means device); "neuron" fails
    vLLM's own check, so it is refused here with that explanation rather than guessed.
    """
    dev = device_type.lower()
    buf = kv_buffer_device.lower()
    if dev == "cpu":
        if buf != "cpu":
            raise ConfigError(
                f'KV tensors are in host memory but kv_buffer_device is {kv_buffer_device!r}; use "cpu"'
            )
        return BackendChoice("host", "DRAM", False, "KV tensors in host memory, registered as DRAM")
    if dev == "cuda":
        kind = "cuda"
    elif dev in NEURON_DEVICE_TYPES:
        kind = "neuron"
        if buf == "neuron":
            raise ConfigError(
                'kv_buffer_device "neuron" is not what vllm-neuron expects: use "cuda" (on Neuron it means '
                'device HBM, registered as VRAM), or "cpu" for host staging'
            )
    else:
        raise ConfigError(f"no kvpush memory backend for KV tensors on device type {device_type!r}")
    if buf == "cpu" or force_staging:
        why = 'kv_buffer_device is "cpu"' if buf == "cpu" else "staging forced by the preflight or config"
        return BackendChoice(kind, "DRAM", True, f"{kind} KV staged through a host bounce buffer: {why}")
    if buf != "cuda":
        raise ConfigError(
            f"kv_buffer_device {kv_buffer_device!r} is not one kvpush understands with {device_type} KV "
            'tensors: "cuda" (device memory as VRAM) or "cpu" (host staging)'
        )
    return BackendChoice(kind, "VRAM", False, f"{kind} device memory registered as VRAM (device-direct)")


@dataclass(frozen=True)
class CacheSetup:
    """What an engine integration needs from the backend: the cache (for the KV-written barrier), the
    layout and memory type to register with the endpoint, and the staging hooks (None: device-direct)."""

    cache: KVCache
    choice: BackendChoice
    layout: KVLayout
    mem_type: str
    hooks: object | None  # a kvpush.endpoint.TransferHooks when staged


def setup_for_tensors(
    layout: KVLayout,
    kv_caches: Mapping[str, Any],
    kv_buffer_device: str,
    *,
    force_staging: bool = False,
    environ: Mapping[str, str] | None = None,
) -> CacheSetup:
    """The backend for an engine's KV tensors, as the layout probe placed them (`layout` from
    `probe_layout`; `kv_caches` the same dict). Picks by the tensors' device and kv_buffer_device."""
    tensors: list[Any] = []
    seen: set[int] = set()
    for t in kv_caches.values():
        base = int(t.untyped_storage().data_ptr())
        if base not in seen:
            seen.add(base)
            tensors.append(t)
    if not tensors:
        raise ConfigError("no KV cache tensors")
    choice = select_backend(str(tensors[0].device.type), kv_buffer_device, force_staging)
    cache: KVCache
    if choice.backend == "host":
        cache = HostKVCache.wrap(layout, keepalive=tensors)
    elif choice.backend == "cuda":
        cache = CudaKVCache.wrap(layout, tensors, environ)
    else:
        cache = NeuronKVCache.wrap(layout, tensors)
    if not choice.staged:
        return CacheSetup(cache, choice, layout, choice.mem_type, None)
    staging = HostStaging(cache)
    return CacheSetup(cache, choice, staging.layout, staging.mem_type, staging)
