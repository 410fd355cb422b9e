"""The demo's host view of a cache for its byte patterns, moving only the blocks a request touches.

The pattern code (pattern.py) works on the cache's bytes on the host. A host cache is its own view. A
device cache (CUDA VRAM) used to be copied whole to the host and back for every request, twice on each
side: about 1 GiB each way per request at the default window, which is what kept the default
`kvpush demo --device cuda` from finishing. `DeviceMirror` keeps one host copy and moves only the rows of
the named blocks (one row of block_bytes per plane and block), in one gather or one scatter.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvpush.errors import LayoutError
from kvpush.protocol.layout import KVLayout, Plane

U8 = npt.NDArray[np.uint8]


def _planes(lay: KVLayout) -> list[Plane]:
    return [lay.plane(layer, kv) for layer in range(lay.num_layers) for kv in range(lay.kv_per_layer)]


class BlockView(Protocol):
    """Host bytes of a cache for the pattern code: `pull` brings these blocks' bytes to the host view and
    returns it (the whole cache's layout); `push` sends these blocks' bytes of that view to the cache."""

    def pull(self, blocks: list[int]) -> U8: ...

    def push(self, blocks: list[int]) -> None: ...


class HostView:
    """A cache in host memory: its buffer is the view, nothing moves."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def pull(self, blocks: list[int]) -> U8:
        buffer: U8 = self.cache.to_host()
        return buffer

    def push(self, blocks: list[int]) -> None:
        return None


class DeviceMirror:
    """A device cache in one flat uint8 tensor (`cache.tensor`, any torch device) with packed planes: a host
    mirror, and the rows of the named blocks gathered to it or scattered from it. Made only where every
    plane starts on a block boundary and blocks are packed (`fits`); elsewhere the whole cache moves."""

    def __init__(self, cache: Any) -> None:
        import torch

        lay = cache.layout
        self.block_bytes = lay.block_bytes
        tensor = cache.tensor
        self.rows = tensor.view(-1, self.block_bytes)  # row r = bytes [r * block_bytes, (r + 1) * ...)
        self.host: U8 = np.zeros(int(tensor.numel()), dtype=np.uint8)
        self.host_rows = self.host.reshape(-1, self.block_bytes)
        # each plane's first row: block b of that plane is row first + b
        self.first = np.array([p.offset // self.block_bytes for p in _planes(lay)], dtype=np.int64)
        self.host_rows[:] = self.rows.cpu().numpy()  # once, at start: the device's bytes as they are
        self._torch = torch

    @staticmethod
    def fits(cache: Any) -> bool:
        lay = cache.layout
        try:
            tensor = cache.tensor
        except LayoutError:  # a cache over several regions (engine tensors): no single tensor
            return False
        return (
            lay.block_stride == lay.block_bytes
            and int(tensor.numel()) % lay.block_bytes == 0
            and all(p.region == 0 and p.offset % lay.block_bytes == 0 for p in _planes(lay))
        )

    def _index(self, blocks: list[int]) -> npt.NDArray[np.int64]:
        return (self.first[:, None] + np.asarray(blocks, dtype=np.int64)[None, :]).reshape(-1)

    def pull(self, blocks: list[int]) -> U8:
        if blocks:
            idx = self._index(blocks)
            got = self.rows.index_select(0, self._torch.from_numpy(idx).to(self.rows.device))
            self.host_rows[idx] = got.cpu().numpy()
        return self.host

    def push(self, blocks: list[int]) -> None:
        if not blocks:
            return
        idx = self._index(blocks)
        dev = self.rows.device
        src = self._torch.from_numpy(np.ascontiguousarray(self.host_rows[idx])).to(dev)
        self.rows.index_copy_(0, self._torch.from_numpy(idx).to(dev), src)
        if dev.type == "cuda":
            self._torch.cuda.synchronize(dev)  # landed before the push thread may read it


class LayerUpload:
    """One request's rows on their way from a DeviceMirror's host copy to the device, a layer at a time (the
    GPU form of the streamed demo's synthetic prefill): the rows of every plane of the named blocks are
    gathered once into one host tensor (pinned on CUDA, so each layer's copy is asynchronous), and
    `enqueue(layer)` queues that layer's rows onto the device on the current stream. Nothing else of the
    cache moves: a request costs its own bytes, not the cache's."""

    def __init__(self, mirror: DeviceMirror, blocks: list[int], num_layers: int) -> None:
        torch = mirror._torch
        self.mirror = mirror
        idx = mirror._index(blocks)  # plane-major: the planes of layer l are rows l*per .. (l+1)*per
        per = idx.shape[0] // num_layers
        dev = mirror.rows.device
        src = torch.from_numpy(np.ascontiguousarray(mirror.host_rows[idx]))
        if dev.type == "cuda":
            src = src.pin_memory()
        self._src = [src[layer * per : (layer + 1) * per] for layer in range(num_layers)]
        self._idx = [
            torch.from_numpy(idx[layer * per : (layer + 1) * per]).to(dev) for layer in range(num_layers)
        ]

    def enqueue(self, layer: int) -> None:
        rows = self.mirror.rows
        rows.index_copy_(0, self._idx[layer], self._src[layer].to(rows.device, non_blocking=True))


class WholeCopy:
    """A device cache that DeviceMirror cannot address by rows: the whole cache to the host and back."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.host: U8 | None = None

    def pull(self, blocks: list[int]) -> U8:
        self.host = self.cache.to_host()
        return self.host

    def push(self, blocks: list[int]) -> None:
        if self.host is not None:
            self.cache.from_host(self.host)


def block_view(cache: Any) -> BlockView:
    """The cheapest host view this cache allows."""
    if getattr(cache, "device_type", "") != "cuda":
        return HostView(cache)
    return DeviceMirror(cache) if DeviceMirror.fits(cache) else WholeCopy(cache)
