"""The KVCache protocol every memory backend implements, and the one place that picks a backend.

A backend tells kvpush how NIXL registers a rank's cache (memory type, device id, regions: all in
`layout`), gives the "this request's KV is written" barrier the engine hands to `prefill_done`, and
copies bytes between the cache and host memory (tests, and host staging for device caches).

The choice of backend is never a default: it follows from the KV tensors' device and vLLM's
`kv_buffer_device`, and an impossible pair is refused with the reason (`select_backend`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvpush.errors import ConfigError
from kvpush.protocol.layout import KVLayout, Region

Barrier = Callable[[], None]
Bytes = npt.NDArray[np.uint8]


class KVCache(Protocol):
    """One rank's KV cache, wherever it lives."""

    layout: KVLayout  # geometry placed in memory: regions (addr, nbytes, device id) and planes
    mem_type: str  # the NIXL memory type its regions register as: "DRAM" or "VRAM"
    device_type: str  # "cpu", "cuda" or "neuron"

    @property
    def device_id(self) -> int: ...

    @property
    def regions(self) -> tuple[Region, ...]: ...

    def kv_written_barrier(self) -> Barrier | None:
        """Called on the engine thread at hand-off; must not wait. Returns what the push thread calls
        before it reads the blocks (None: host memory is written when the engine step returns)."""
        ...

    def read_into(self, region: int, offset: int, out: Bytes) -> None:
        """Copy len(out) bytes at `offset` of region `region` into host array `out` (blocking)."""
        ...

    def write_from(self, region: int, offset: int, src: Bytes) -> None:
        """Copy host array `src` to `offset` of region `region` (complete when it returns)."""
        ...


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


def block_runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(first block, count) for each run of consecutive ids in sorted order: one copy per run."""
    ids = sorted(set(int(b) for b in block_ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        yield ids[i], j - i + 1
        i = j + 1


def whole_cache_to_host(cache: KVCache) -> list[Bytes]:
    """Every region of a cache copied to host (for checking test patterns)."""
    out = []
    for i, r in enumerate(cache.regions):
        buf = np.empty(r.nbytes, dtype=np.uint8)
        cache.read_into(i, 0, buf)
        out.append(buf)
    return out


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
        from .host import HostMemoryKVCache

        cache = HostMemoryKVCache(layout, keepalive=tensors)
    elif choice.backend == "cuda":
        from .cuda import CudaTensorKVCache

        cache = CudaTensorKVCache(layout, tensors, environ)
    else:
        from .neuron import NeuronKVCache

        cache = NeuronKVCache.from_tensors(layout, tensors)
    if not choice.staged:
        return CacheSetup(cache, choice, layout, choice.mem_type, None)
    from .staging import HostStaging

    staging = HostStaging(cache)
    return CacheSetup(cache, choice, staging.layout, staging.mem_type, staging)
