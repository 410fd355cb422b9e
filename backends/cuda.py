"""CUDA VRAM KV caches, registered with NIXL as VRAM (GPUDirect RDMA where the NIC supports it; on one
host UCX moves VRAM with cuda_ipc / cuda_copy).

Like the host backend, one allocation holds every plane back to back, so a rank's cache is one
registration. torch is imported lazily: the core never needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpush.protocol.layout import KVLayout, packed_planes


class CudaUnavailable(RuntimeError):
    """torch with CUDA is not installed or no GPU is visible."""


class CudaKVCache:
    mem_type = "VRAM"

    def __init__(self, layout: KVLayout, device: int = 0) -> None:
        try:
            import torch
        except ImportError as exc:
            raise CudaUnavailable("the CUDA backend needs torch with CUDA support") from exc
        if not torch.cuda.is_available():
            raise CudaUnavailable("torch sees no CUDA device")
        plane_bytes = layout.num_blocks * layout.block_stride
        nbytes = plane_bytes * layout.num_layers * layout.kv_per_layer
        self.device = device
        self.tensor: Any = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.layout = packed_planes(layout, int(self.tensor.data_ptr()), device_id=device)

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def to_host(self) -> np.ndarray:
        """A host copy of the whole cache (for filling and checking test patterns)."""
        return np.asarray(self.tensor.cpu().numpy())

    def from_host(self, host: np.ndarray) -> None:
        import torch

        self.tensor.copy_(torch.from_numpy(host))
        torch.cuda.synchronize(self.device)
