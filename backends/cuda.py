"""CUDA VRAM KV caches, registered with NIXL as VRAM (GPUDirect RDMA where the NIC supports it; on one
host UCX moves VRAM with cuda_ipc / cuda_copy).

The "KV written" barrier is a CUDA event recorded on the stream that wrote the KV, at hand-off: recording
is asynchronous, so the engine thread never waits; the push thread calls the event's `synchronize`
before it posts the WRITE. (The old connector synchronised the whole stream on the engine's loop.)

Memory from PyTorch's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) is
refused: it is CUDA VMM memory, whose EFA registration fails (EINVAL) and whose ranges can be remapped.
torch is imported lazily: the core never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvpush.errors import ConfigError, LayoutError
from kvpush.protocol.layout import KVLayout, Region, packed_planes

from .base import Barrier, Bytes


class CudaUnavailable(ConfigError):
    """torch with CUDA is not installed or no GPU is visible."""


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def check_allocator_config(environ: Mapping[str, str] | None = None) -> None:
    """Refuse expandable segments, naming the variable that turns them on."""
    env = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        opts = {
            k.strip(): v.strip()
            for k, _, v in (item.partition(":") for item in env.get(var, "").split(","))
            if k.strip()
        }
        if opts.get("expandable_segments", "").lower() in ("true", "1"):
            raise ConfigError(
                f"{var} enables expandable_segments: PyTorch then allocates the KV cache as CUDA VMM "
                "memory, which EFA cannot register (EINVAL) and which may be remapped under a registration. "
                f"Unset it (or set expandable_segments:False) for engines that push KV with kvpush"
            )


def cuda_event_barrier(device: int | None = None, stream: Any = None) -> Barrier:
    """Record a CUDA event on `stream` (default: the current stream of `device`) and return its
    `synchronize`. Call on the engine thread right after the kernels that write the KV were queued:
    recording queues a marker and returns at once."""
    import torch

    ev: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream if stream is not None else torch.cuda.current_stream(device))
    sync: Barrier = ev.synchronize
    return sync


def _require_cuda() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise CudaUnavailable("the CUDA backend needs torch with CUDA support") from exc
    if not torch.cuda.is_available():
        raise CudaUnavailable("torch sees no CUDA device")
    return torch


class CudaKVCache:
    """A rank's KV cache in VRAM: allocated here (`CudaKVCache(layout, device)`, every plane back to back,
    one registration) or owned by the engine (`CudaKVCache.wrap`, vLLM's tensors, one per layer).

    Region copies (push/decode thread) go through flat uint8 views of the regions' device storages.
    """

    mem_type = "VRAM"
    device_type = "cuda"

    layout: KVLayout
    device: int
    flat: list[Any]  # one flat uint8 tensor per region, over the region's storage

    def __init__(self, layout: KVLayout, device: int = 0, environ: Mapping[str, str] | None = None) -> None:
        """Allocate zeroed VRAM on `device` for the whole cache."""
        check_allocator_config(environ)
        torch = _require_cuda()
        plane_bytes = layout.num_blocks * layout.block_stride
        nbytes = plane_bytes * layout.num_layers * layout.kv_per_layer
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self._place(packed_planes(layout, int(tensor.data_ptr()), device_id=device), [tensor], device)

    @classmethod
    def wrap(
        cls, layout: KVLayout, tensors: list[Any], environ: Mapping[str, str] | None = None
    ) -> CudaKVCache:
        """VRAM KV tensors the engine owns, described by the probe's placed layout.

        `tensors` are the engine's KV tensors in region order (one per region: the probe makes one region
        per distinct storage); they are kept alive through the flat views the copies use.
        """
        check_allocator_config(environ)
        import torch

        if len(tensors) != len(layout.regions):
            raise LayoutError(f"{len(tensors)} tensors for {len(layout.regions)} regions")
        flat = []
        for t, r in zip(tensors, layout.regions, strict=True):
            view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            if int(view.data_ptr()) != r.addr:
                raise LayoutError(f"tensor storage at {view.data_ptr():#x} is not region {r}")
            flat.append(view)
        cache = cls.__new__(cls)
        cache._place(layout, flat, layout.regions[0].device_id)
        return cache

    def _place(self, layout: KVLayout, flat: list[Any], device: int) -> None:
        self.layout = layout
        self.flat = flat
        self.device = device

    @property
    def tensor(self) -> Any:
        """The whole cache as one flat tensor (a cache in one region: every allocated one)."""
        if len(self.flat) != 1:
            raise LayoutError(f"this CUDA cache spans {len(self.flat)} regions, not one tensor")
        return self.flat[0]

    @property
    def nbytes(self) -> int:
        return sum(int(f.numel()) for f in self.flat)

    @property
    def device_id(self) -> int:
        return self.device

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.layout.regions

    def kv_written_barrier(self) -> Barrier | None:
        return cuda_event_barrier(self.device)

    def read_into(self, region: int, offset: int, out: Bytes) -> None:
        import torch

        src = self.flat[region][offset : offset + out.nbytes]
        if src.numel() != out.nbytes:
            raise LayoutError(f"copy of {out.nbytes} bytes at {offset} overruns region {region}")
        torch.from_numpy(out).copy_(src)  # device -> pageable host: synchronous

    def write_from(self, region: int, offset: int, src: Bytes) -> None:
        import torch

        dst = self.flat[region][offset : offset + src.nbytes]
        if dst.numel() != src.nbytes:
            raise LayoutError(f"copy of {src.nbytes} bytes at {offset} overruns region {region}")
        dst.copy_(torch.from_numpy(src))
        torch.cuda.current_stream(dst.device).synchronize()  # complete before "ready" (not the engine thread)

    def to_host(self) -> np.ndarray:
        """A host copy of the whole cache (for filling and checking test patterns)."""
        return np.asarray(self.tensor.cpu().numpy())

    def from_host(self, host: np.ndarray) -> None:
        import torch

        self.tensor.copy_(torch.from_numpy(host))
        torch.cuda.synchronize(self.device)
