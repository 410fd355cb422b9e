"""Host DRAM KV caches, registered with NIXL as DRAM.

One page-aligned buffer holds every plane back to back, so a whole rank's cache is one registration.
"""

from __future__ import annotations

import mmap

import numpy as np

from kvpush.protocol.layout import KVLayout, packed_planes


class HostKVCache:
    """A rank's KV cache in host memory (numpy uint8), placed with `packed_planes`."""

    mem_type = "DRAM"

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
