"""Host DRAM KV caches, registered with NIXL as DRAM.

`HostKVCache` allocates: one page-aligned buffer holds every plane back to back, so a whole rank's cache
is one registration. `HostMemoryKVCache` describes host memory someone else owns (vLLM's CPU tensors, as
the layout probe placed them).
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from kvpush.errors import LayoutError
from kvpush.protocol.layout import KVLayout, Region, packed_planes

from .base import Barrier, Bytes


class _HostCopies:
    """Region copies for host memory: plain memmoves, bounds-checked (a bad offset must not scribble)."""

    layout: KVLayout

    def _span(self, region: int, offset: int, nbytes: int) -> int:
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


class HostKVCache(_HostCopies):
    """A rank's KV cache in host memory (numpy uint8), placed with `packed_planes`."""

    mem_type = "DRAM"
    device_type = "cpu"

    def __init__(self, layout: KVLayout, prefault: bool = True) -> None:
        plane_bytes = layout.num_blocks * layout.block_stride
        nbytes = plane_bytes * layout.num_layers * layout.kv_per_layer
        # anonymous mmap: page-aligned, released with the object. Touched once up front, as an engine's
        # torch.zeros cache is: otherwise the first transfer into each page pays a page fault.
        self._mmap = mmap.mmap(-1, max(nbytes, 1))
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes)
        if prefault:
            self.buffer.fill(0)
        self.layout = packed_planes(layout, int(self.buffer.ctypes.data))

    @property
    def nbytes(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def device_id(self) -> int:
        return 0

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.layout.regions

    def kv_written_barrier(self) -> Barrier | None:
        return None  # host KV is written when the engine's step returns

    def to_host(self) -> np.ndarray:
        """The cache itself (the same interface as device backends, which return a copy)."""
        return self.buffer

    def from_host(self, host: np.ndarray) -> None:
        if host is not self.buffer:
            self.buffer[:] = host

    def block_view(self, layer: int, kv: int, block_id: int) -> np.ndarray:
        """uint8 view of one block of one plane."""
        lay = self.layout
        start = lay.plane(layer, kv).offset + block_id * lay.block_stride
        return self.buffer[start : start + lay.block_bytes]

    def token_view(self, layer: int, kv: int, block_id: int, token: int, local_head: int) -> np.ndarray:
        """uint8 view of one (token, head) unit."""
        lay = self.layout
        start = lay.plane(layer, kv).offset + block_id * lay.block_stride + lay.unit_offset(token, local_head)
        return self.buffer[start : start + lay.unit_bytes]


class HostMemoryKVCache(_HostCopies):
    """Host memory the engine owns (vLLM's CPU KV tensors), described by a placed layout.

    `keepalive` holds the owner's tensors so the addresses stay valid as long as this object lives.
    """

    mem_type = "DRAM"
    device_type = "cpu"

    def __init__(self, layout: KVLayout, keepalive: object = None) -> None:
        if not layout.regions:
            raise LayoutError("HostMemoryKVCache needs a layout placed in memory (regions and planes)")
        self.layout = layout
        self._keepalive = keepalive

    @property
    def device_id(self) -> int:
        return 0

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.layout.regions

    def kv_written_barrier(self) -> Barrier | None:
        return None
