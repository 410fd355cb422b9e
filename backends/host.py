"""Host DRAM KV caches, registered with NIXL as DRAM.

One class, two constructors: `HostKVCache(layout)` allocates one page-aligned buffer holding every plane
back to back, so a whole rank's cache is one registration; `HostKVCache.wrap(layout, keepalive)` describes
host memory someone else owns (vLLM's CPU tensors, as the layout probe placed them).
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from kvpush.errors import LayoutError
from kvpush.protocol.layout import KVLayout, Region, packed_planes

from .base import Barrier, Bytes


def _region_view(region: Region) -> Bytes:
    """A uint8 array over a region's memory (valid while the memory's owner lives)."""
    if region.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.addr))


class HostKVCache:
    """A rank's KV cache in host memory: allocated here (`HostKVCache(layout)`, placed with
    `packed_planes`) or owned by the engine (`HostKVCache.wrap`)."""

    mem_type = "DRAM"
    device_type = "cpu"

    layout: KVLayout
    _views: list[Bytes]  # one uint8 array per region, for the views and whole-cache copies
    _keepalive: object  # what owns the memory: our mmap, or the engine's tensors

    def __init__(self, layout: KVLayout, prefault: bool = True) -> None:
        """Allocate: an anonymous mmap (page-aligned, released with the object). Touched once up front, as
        an engine's torch.zeros cache is: otherwise the first transfer into each page pays a page fault."""
        plane_bytes = layout.num_blocks * layout.block_stride
        nbytes = plane_bytes * layout.num_layers * layout.kv_per_layer
        mapping = mmap.mmap(-1, max(nbytes, 1))
        buffer = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
        if prefault:
            buffer.fill(0)
        self._place(packed_planes(layout, int(buffer.ctypes.data)), [buffer], mapping)

    @classmethod
    def wrap(cls, layout: KVLayout, keepalive: object = None) -> HostKVCache:
        """Host memory the engine owns, described by a placed layout; `keepalive` holds the owner's tensors
        so the addresses stay valid as long as this object lives."""
        if not layout.regions:
            raise LayoutError("HostKVCache.wrap needs a layout placed in memory (regions and planes)")
        cache = cls.__new__(cls)
        cache._place(layout, [_region_view(r) for r in layout.regions], keepalive)
        return cache

    def _place(self, layout: KVLayout, views: list[Bytes], keepalive: object) -> None:
        self.layout = layout
        self._views = views
        self._keepalive = keepalive

    @property
    def buffer(self) -> Bytes:
        """The whole cache as one array (a cache in one region: every allocated one)."""
        if len(self._views) != 1:
            raise LayoutError(f"this host cache spans {len(self._views)} regions, not one buffer")
        return self._views[0]

    @property
    def nbytes(self) -> int:
        return sum(int(v.shape[0]) for v in self._views)

    @property
    def device_id(self) -> int:
        return 0

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.layout.regions

    def kv_written_barrier(self) -> Barrier | None:
        return None  # host KV is written when the engine's step returns

    def _span(self, region: int, offset: int, nbytes: int) -> int:
        """Bounds-checked address (a bad offset must not scribble)."""
        r = self.layout.regions[region]
        if offset < 0 or offset + nbytes > r.nbytes:
            raise LayoutError(
                f"copy of {nbytes} bytes at {offset} overruns region {region} ({r.nbytes} bytes)"
            )
        return r.addr + offset

    def read_into(self, region: int, offset: int, out: Bytes) -> None:
        ctypes.memmove(int(out.ctypes.data), self._span(region, offset, out.nbytes), out.nbytes)

    def write_from(self, region: int, offset: int, src: Bytes) -> None:
        ctypes.memmove(self._span(region, offset, src.nbytes), int(src.ctypes.data), src.nbytes)

    def to_host(self) -> np.ndarray:
        """The cache itself (the same interface as device backends, which return a copy)."""
        return self.buffer

    def from_host(self, host: np.ndarray) -> None:
        if host is not self.buffer:
            self.buffer[:] = host

    def block_view(self, layer: int, kv: int, block_id: int) -> np.ndarray:
        """uint8 view of one block of one plane."""
        lay = self.layout
        plane = lay.plane(layer, kv)
        start = plane.offset + block_id * lay.block_stride
        return self._views[plane.region][start : start + lay.block_bytes]

    def token_view(self, layer: int, kv: int, block_id: int, token: int, local_head: int) -> np.ndarray:
        """uint8 view of one (token, head) unit."""
        lay = self.layout
        plane = lay.plane(layer, kv)
        start = plane.offset + block_id * lay.block_stride + lay.unit_offset(token, local_head)
        return self._views[plane.region][start : start + lay.unit_bytes]
