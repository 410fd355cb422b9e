"""Neuron device memory (Trainium), pushed with NIXL's LIBFABRIC backend over EFA (Neuron Direct RDMA).

NIXL registers Neuron device memory as VRAM; its LIBFABRIC plugin marks it FI_HMEM_NEURON and picks the
EFA rail attached to the Neuron device. kvpush needs only the cache's device address, size and device
index, which the serving stack (vLLM-Neuron) owns; this module turns them into a layout and a config.

Not run here: no Trainium, no EFA, and the LIBFABRIC plugin needs libfabric >= 1.21. Tests cover the
configuration and the clear error when the backend cannot load.
"""

from __future__ import annotations

from kvpush.config import KVPushConfig
from kvpush.protocol.layout import KVLayout, LayoutError, packed_planes


class NeuronKVCache:
    """A rank's KV cache that already lives in Neuron device memory (allocated by the engine)."""

    mem_type = "VRAM"

    def __init__(self, layout: KVLayout, device_addr: int, nbytes: int, neuron_device: int) -> None:
        need = layout.num_blocks * layout.block_stride * layout.num_layers * layout.kv_per_layer
        if nbytes < need:
            raise LayoutError(f"Neuron buffer of {nbytes} bytes is smaller than the layout's {need}")
        if device_addr <= 0:
            raise LayoutError("Neuron buffer address must be a device address > 0")
        self.layout = packed_planes(layout, device_addr, device_id=neuron_device)
        self.nbytes = nbytes


def neuron_config(engine_id: str, host: str, port: int = 5600, **overrides: object) -> KVPushConfig:
    """LIBFABRIC over EFA; UCX's loopback restriction does not apply."""
    base = dict(engine_id=engine_id, host=host, port=port, backends=("LIBFABRIC",), ucx_net_devices=None)
    base.update(overrides)
    return KVPushConfig.from_mapping(base)
