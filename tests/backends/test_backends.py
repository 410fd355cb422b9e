"""Backends: host placement, and the Neuron/LIBFABRIC configuration (its data path needs Trainium + EFA)."""

from __future__ import annotations

import pytest

from kvpush.backends.host import HostKVCache
from kvpush.backends.neuron import NeuronKVCache, NeuronPrerequisiteError, neuron_config
from kvpush.protocol.layout import KVLayout, packed_planes
from kvpush.transport.base import TransportError
from kvpush.transport.nixl import NixlTransport

LAYOUT = KVLayout(num_layers=2, block_size=16, num_blocks=8, total_kv_heads=1, head_dim=128, dtype_size=2)


def test_host_cache_places_every_plane_inside_its_region():
    cache = HostKVCache(LAYOUT)
    region = cache.layout.regions[0]
    assert region.addr == cache.buffer.ctypes.data and region.nbytes == cache.nbytes
    assert cache.layout.address(1, 1, 7, 15, 0) + 256 <= region.addr + region.nbytes
    assert not cache.buffer.any()  # prefaulted with zeros


def test_neuron_config_selects_libfabric():
    cfg = neuron_config("trn-prefill", "10.0.0.7")
    assert cfg.backends == ("LIBFABRIC",) and cfg.ucx_net_devices is None and cfg.port == 5600


def test_neuron_cache_refuses_address_zero_with_the_map_hbm_explanation():
    placed = packed_planes(LAYOUT, 0)
    with pytest.raises(NeuronPrerequisiteError, match="NEURON_RT_MAP_HBM=1"):
        NeuronKVCache(placed, lambda *a: None, lambda *a: None)


def test_libfabric_unavailable_here_fails_with_a_clear_error():
    """The agent must not come up without the backend it was asked for (NIXL only warns)."""
    with pytest.raises(TransportError, match="LIBFABRIC"):
        NixlTransport("lf-probe", backends=("LIBFABRIC",), environ={})
