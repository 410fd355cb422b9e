"""Backends: host placement, and the Neuron/LIBFABRIC configuration (its data path needs Trainium + EFA)."""

from __future__ import annotations

import numpy as np
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

    from kvpush.backends.select import setup_for_tensors
    from kvpush.errors import ConfigError
    from kvpush.platforms.vllm.layout_probe import CPU_VIEW, probe_layout

    caches = {f"l{i}": torch.zeros(4, 2, 16, 64, dtype=torch.float16) for i in range(2)}
    probed = probe_layout(caches, block_size=16, total_kv_heads=2, tp_rank=0, tp_size=1, declared=CPU_VIEW)
    setup = setup_for_tensors(probed.layout, caches, "cpu")
    assert setup.mem_type == "DRAM" and setup.hooks is None and setup.layout is probed.layout
    assert setup.cache.kv_written_barrier() is None and len(setup.cache.regions) == 2
    with pytest.raises(ConfigError, match="kv_buffer_device"):
        setup_for_tensors(probed.layout, caches, "cuda")


def test_wrapped_host_memory_is_the_engines_own_bytes_and_refuses_to_be_one_buffer():
    """`HostKVCache.wrap` describes memory it does not own: its views and copies reach the engine's
    tensors (one region per layer here), and the one-buffer accessors refuse a cache of two regions."""
    import torch

    from kvpush.errors import LayoutError
    from kvpush.platforms.vllm.layout_probe import CPU_VIEW, probe_layout

    caches = {f"l{i}": torch.zeros(4, 2, 16, 64, dtype=torch.float16) for i in range(2)}
    probed = probe_layout(caches, block_size=16, total_kv_heads=2, tp_rank=0, tp_size=1, declared=CPU_VIEW)
    cache = HostKVCache.wrap(probed.layout, keepalive=list(caches.values()))
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in caches.values())
    cache.block_view(1, 0, 3)[:] = 7
    raw = caches["l1"].view(torch.uint8).numpy().reshape(-1)
    plane = cache.layout.plane(1, 0)
    start = plane.offset + 3 * cache.layout.block_stride
    assert (raw[start : start + cache.layout.block_bytes] == 7).all()
    assert int((raw != 0).sum()) == cache.layout.block_bytes  # nothing else was touched
    out = np.empty(16, dtype=np.uint8)
    cache.read_into(plane.region, start, out)
    assert (out == 7).all()
    with pytest.raises(LayoutError, match="2 regions"):
        cache.to_host()
    with pytest.raises(LayoutError, match="placed in memory"):
        HostKVCache.wrap(LAYOUT)
