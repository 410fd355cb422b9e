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
    assert (
        cfg.nixl.backends == ("LIBFABRIC",)
        and cfg.nixl.ucx_net_devices is None
        and cfg.side_channel.port == 5600
    )


def test_neuron_cache_refuses_address_zero_with_the_map_hbm_explanation():
    placed = packed_planes(LAYOUT, 0)
    with pytest.raises(NeuronPrerequisiteError, match="NEURON_RT_MAP_HBM=1"):
        NeuronKVCache(placed, lambda *a: None, lambda *a: None)


def test_libfabric_unavailable_here_fails_with_a_clear_error():
    """The agent must not come up without the backend it was asked for (NIXL only warns)."""
    with pytest.raises(TransportError, match="LIBFABRIC"):
        NixlTransport("lf-probe", backends=("LIBFABRIC",), environ={})


def test_setup_for_vllm_cpu_tensors_picks_host_memory_and_never_defaults():
    import torch

    from kvpush.backends.base import setup_for_tensors
    from kvpush.errors import ConfigError
    from kvpush.platforms.vllm.layout_probe import CPU_VIEW, probe_layout

    caches = {f"l{i}": torch.zeros(4, 2, 16, 64, dtype=torch.float16) for i in range(2)}
    probed = probe_layout(caches, block_size=16, total_kv_heads=2, tp_rank=0, tp_size=1, declared=CPU_VIEW)
    setup = setup_for_tensors(probed.layout, caches, "cpu")
    assert setup.mem_type == "DRAM" and setup.hooks is None and setup.layout is probed.layout
    assert setup.cache.kv_written_barrier() is None and len(setup.cache.regions) == 2
    with pytest.raises(ConfigError, match="kv_buffer_device"):
        setup_for_tensors(probed.layout, caches, "cuda")
