"""The KVCache protocol every memory backend implements, and the helpers they share.

A backend tells kvpush how NIXL registers a rank's cache (memory type, device id, regions: all in
`layout`), gives the "this request's KV is written" barrier the engine hands to `prefill_done`, and
copies bytes between the cache and host memory (tests, and host staging for device caches).

This module imports no backend (each backend imports it); picking one is select.py's job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

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
