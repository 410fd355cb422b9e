"""Backends: host placement, and the Neuron/LIBFABRIC configuration (its data path needs Trainium + EFA)."""

from __future__ import annotations

import pytest

from kvpush.backends.host import HostKVCache
from kvpush.backends.neuron import NeuronKVCache, neuron_config
from kvpush.protocol.layout import KVLayout, LayoutError
from kvpush.transport.base import TransportError
from kvpush.transport.nixl import NixlTransport

LAYOUT = KVLayout(num_layers=2, block_size=16, num_blocks=8, total_kv_heads=1, head_dim=128, dtype_size=2)


def test_host_cache_places_every_plane_inside_its_region():
    cache = HostKVCache(LAYOUT)
    region = cache.layout.regions[0]
    assert region.addr == cache.buffer.ctypes.data and region.nbytes == cache.nbytes
    assert cache.layout.address(1, 1, 7, 15, 0) + 256 <= region.addr + region.nbytes
    assert not cache.buffer.any()  # prefaulted with zeros


def test_neuron_layout_and_config():
    cache = NeuronKVCache(LAYOUT, device_addr=0x7F0000000000, nbytes=1 << 22, neuron_device=3)
    assert cache.mem_type == "VRAM" and cache.layout.regions[0].device_id == 3
    cfg = neuron_config("trn-prefill", "10.0.0.7")
    assert cfg.backends == ("LIBFABRIC",) and cfg.ucx_net_devices is None and cfg.port == 5600
    with pytest.raises(LayoutError, match="smaller"):
        NeuronKVCache(LAYOUT, device_addr=0x1000, nbytes=10, neuron_device=0)


def test_libfabric_unavailable_here_fails_with_a_clear_error():
    """The agent must not come up without the backend it was asked for (NIXL only warns)."""
    with pytest.raises(TransportError, match="LIBFABRIC"):
        NixlTransport("lf-probe", backends=("LIBFABRIC",), environ={})
