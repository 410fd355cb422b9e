"""The Neuron backend against the libnrt stand-in (a C library written for these tests, NOT the Neuron
runtime): symbol and version probing, the prerequisite errors, and the real data path: stand-in device
memory (malloc'd) registered with NIXL as DRAM, real NixlTransport over UCX loopback, real prefill and
decode endpoints, every byte verified; and host staging from and to stand-in device memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpush.backends.base import KVCache, block_runs, whole_cache_to_host
from kvpush.backends.host import HostKVCache
from kvpush.backends.neuron import (
    NeuronKVCache,
    NeuronPrerequisiteError,
    NeuronRuntime,
    apply_neuron_environment,
    check_neuron_prerequisites,
)
from kvpush.backends.select import select_backend
from kvpush.backends.staging import HostStaging
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.errors import ConfigError, TransportError
from kvpush.protocol.layout import KVLayout

GEO = KVLayout(
    num_layers=3, block_size=16, num_blocks=24, total_kv_heads=2, head_dim=32, dtype_size=2, token_order="HND"
)
Loader = Callable[..., NeuronRuntime]


@pytest.fixture
def runtime(load_standin: Loader, monkeypatch: pytest.MonkeyPatch) -> NeuronRuntime:
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
    rt = load_standin()
    assert rt.lib.nrt_init(0, b"", b"") == 0
    return rt


def test_symbol_and_version_probing(load_standin: Loader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
    rt = load_standin()
    assert rt.version() == (2, 31, 24, 0) and rt.has_symbol("nrt_get_attached_efa_bdf")
    assert not rt.initialised()
    rt.lib.nrt_init(0, b"", b"")
    assert rt.initialised()
    h = rt.tensor_allocate(1 << 16, logical_nc=2)
    va = rt.tensor_va(h)
    assert va and rt.attached_efa_bdf(va + 100) == "0000:11:1c.0"
    assert rt.attached_efa_bdf(va + (1 << 20)) is None
    rt.tensor_free(h)
    old = load_standin("old")
    assert old.version()[:3] == (2, 30, 0) and old.attached_efa_bdf(va) is None


def test_runtime_not_loadable_is_named() -> None:
    with pytest.raises(NeuronPrerequisiteError, match="not loadable"):
        NeuronRuntime.load("/nonexistent/libnrt.so.1")


def test_prerequisites_are_refused_by_name(load_standin: Loader, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"NEURON_RT_MAP_HBM": "1", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}
    rt = load_standin()
    with pytest.raises(NeuronPrerequisiteError, match="not initialised.*before creating the NIXL agent"):
        check_neuron_prerequisites(rt, single_host=True, environ=env)
    with pytest.raises(NeuronPrerequisiteError, match="NEURON_RT_MAP_HBM is None"):
        check_neuron_prerequisites(rt, single_host=True, environ={})
    rt.lib.nrt_init(0, b"", b"")
    check_neuron_prerequisites(rt, single_host=True, environ=env)
    with pytest.raises(NeuronPrerequisiteError, match="FI_EFA_ENABLE_SHM_TRANSFER=0"):
        check_neuron_prerequisites(rt, single_host=True, environ={"NEURON_RT_MAP_HBM": "1"})
    check_neuron_prerequisites(rt, single_host=False, environ={"NEURON_RT_MAP_HBM": "1"})

    class NoLibfabric:
        def __init__(self) -> None:
            self.backends = {"UCX": object()}

        def get_plugin_list(self) -> list[str]:
            return ["UCX"]

        def get_backend_mem_types(self, backend: str) -> list[str]:
            return ["DRAM_SEG"]

    with pytest.raises(TransportError, match="'LIBFABRIC' did not load"):
        check_neuron_prerequisites(rt, single_host=False, environ=env, agent=NoLibfabric())
    old = load_standin("old")
    old.lib.nrt_init(0, b"", b"")
    with pytest.raises(
        NeuronPrerequisiteError, match=r"2\.30\.0\.0 .* lacks nrt_get_attached_efa_bdf.*>= 2\.31\.24"
    ):
        check_neuron_prerequisites(old, single_host=False, environ=env)


def test_without_map_hbm_device_memory_has_no_address(
    load_standin: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NEURON_RT_MAP_HBM", raising=False)
    rt = load_standin()
    rt.lib.nrt_init(0, b"", b"")  # started without HBM mapping
    with pytest.raises(NeuronPrerequisiteError, match="no virtual address.*NEURON_RT_MAP_HBM=1"):
        NeuronKVCache.allocate(GEO, rt)
    env: dict[str, str] = {}
    with pytest.raises(NeuronPrerequisiteError, match="already initialised without HBM mapping"):
        apply_neuron_environment(single_host=True, environ=env, runtime=rt)


def test_environment_is_set_and_conflicts_refused() -> None:
    env: dict[str, str] = {"FI_PROVIDER": "efa"}
    assert apply_neuron_environment(single_host=True, environ=env) == {
        "NEURON_RT_MAP_HBM": "1",
        "FI_EFA_ENABLE_SHM_TRANSFER": "0",
    }
    with pytest.raises(NeuronPrerequisiteError, match="FI_EFA_ENABLE_SHM_TRANSFER=1 but"):
        apply_neuron_environment(single_host=True, environ={"FI_EFA_ENABLE_SHM_TRANSFER": "1"})


def test_backend_selection_follows_device_and_kv_buffer_device() -> None:
    assert select_backend("cpu", "cpu").mem_type == "DRAM"
    assert select_backend("neuron", "cuda").mem_type == "VRAM"
    assert select_backend("privateuseone", "cuda").backend == "neuron"
    staged = select_backend("neuron", "cpu")
    assert staged.staged and staged.mem_type == "DRAM"
    assert select_backend("cuda", "cuda", force_staging=True).staged
    with pytest.raises(ConfigError, match='"neuron" is not what vllm-neuron expects'):
        select_backend("neuron", "neuron")
    with pytest.raises(ConfigError, match="host memory but kv_buffer_device"):
        select_backend("cpu", "cuda")
    with pytest.raises(ConfigError, match="device type 'xla'"):
        select_backend("xla", "cuda")
    assert list(block_runs([7, 3, 4, 5, 9, 8])) == [(3, 3), (7, 3)]


def test_one_region_per_layer_with_two_planes(runtime: NeuronRuntime) -> None:
    cache = NeuronKVCache.allocate(GEO, runtime)
    try:
        lay = cache.layout
        assert len(lay.regions) == 3 and lay.kv_per_layer == 2
        assert lay.plane(2, 1).region == 2 and lay.plane(2, 1).offset == GEO.num_blocks * GEO.block_bytes
        assert runtime.attached_efa_bdf(lay.regions[1].addr) == "0000:10:1c.0"
        check_neuron_prerequisites(
            runtime, single_host=False, regions=lay.regions, environ={"NEURON_RT_MAP_HBM": "1"}
        )
    finally:
        cache.free()


# ---- the real data path over NIXL UCX loopback -----------------------------------------------------


def _fill(cache: KVCache, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i, r in enumerate(cache.regions):
        data = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
        cache.write_from(i, 0, data)
        out.append(data)
    return out


def _block(data: list[np.ndarray], lay: KVLayout, layer: int, kv: int, block: int) -> np.ndarray:
    p = lay.plane(layer, kv)
    start = p.offset + block * lay.block_stride
    return data[p.region][start : start + lay.block_bytes]


def _push(
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_hooks: object,
    dst_hooks: object,
    s_blocks: list[int],
    d_blocks: list[int],
    tokens: int,
) -> None:
    cfg = dict(lease_s=20.0, ready_timeout_s=30.0)
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, **cfg)), src_layout, "DRAM", hooks=src_hooks
    )  # type: ignore[arg-type]
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", **cfg)), dst_layout, "DRAM", hooks=dst_hooks
    )  # type: ignore[arg-type]
    p.start()
    d.start()
    try:
        addr = PrefillAddress("P", *p.address)
        d.expect("req", d_blocks, tokens, addr)
        p.prefill_done("req", s_blocks, tokens)
        deadline = time.monotonic() + 30
        got = []
        while not got and time.monotonic() < deadline:
            got = d.finished()
            time.sleep(0.01)
        assert got and got[0].ok, got
        sent = []
        while not sent and time.monotonic() < deadline:
            sent = p.finished()
            time.sleep(0.01)
        assert sent and sent[0].ok, sent
    finally:
        d.close()
        p.close()


def _check(
    src: list[np.ndarray],
    dst_before: list[np.ndarray],
    dst_after: list[np.ndarray],
    lay: KVLayout,
    s_blocks: list[int],
    d_blocks: list[int],
) -> None:
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_per_layer):
            for s, d in zip(s_blocks, d_blocks, strict=True):
                assert np.array_equal(_block(src, lay, layer, kv, s), _block(dst_after, lay, layer, kv, d))
            for b in set(range(lay.num_blocks)) - set(d_blocks):  # nothing else was touched
                assert np.array_equal(
                    _block(dst_before, lay, layer, kv, b), _block(dst_after, lay, layer, kv, b)
                )


@pytest.fixture
def two_devices(
    load_standin: Loader, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[NeuronKVCache, NeuronKVCache]]:
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
    monkeypatch.delenv("KVPUSH_BACKENDS", raising=False)
    rt_p, rt_d = load_standin(), load_standin()
    for rt in (rt_p, rt_d):
        rt.lib.nrt_init(0, b"", b"")
    src, dst = NeuronKVCache.allocate(GEO, rt_p), NeuronKVCache.allocate(GEO, rt_d, logical_nc=1)
    yield src, dst
    src.free()
    dst.free()


S_BLOCKS, D_BLOCKS, TOKENS = [4, 5, 6, 11, 2], [20, 1, 2, 3, 9], 5 * 16


def test_standin_device_memory_pushed_over_real_nixl(
    two_devices: tuple[NeuronKVCache, NeuronKVCache],
) -> None:
    src, dst = two_devices
    src_data = _fill(src, 1)
    before = _fill(dst, 2)
    _push(src.layout, dst.layout, None, None, S_BLOCKS, D_BLOCKS, TOKENS)  # stand-in memory is DRAM to NIXL
    _check(src_data, before, whole_cache_to_host(dst), dst.layout, S_BLOCKS, D_BLOCKS)


def test_host_staging_from_and_to_standin_device_over_real_nixl(
    two_devices: tuple[NeuronKVCache, NeuronKVCache],
) -> None:
    src, dst = two_devices
    src_data = _fill(src, 3)
    before = _fill(dst, 4)
    s_stage, d_stage = HostStaging(src), HostStaging(dst)
    _push(s_stage.layout, d_stage.layout, s_stage, d_stage, S_BLOCKS, D_BLOCKS, TOKENS)
    _check(src_data, before, whole_cache_to_host(dst), dst.layout, S_BLOCKS, D_BLOCKS)
    per_side = TOKENS * GEO.bytes_per_token
    assert s_stage.stats()["bytes"] == per_side == d_stage.stats()["bytes"]
    assert s_stage.stats()["copies"] == 3 * 2 * 3  # runs [2], [4,5,6], [11] per plane


def test_host_staging_with_host_memory_pretending_to_be_a_device() -> None:
    src, dst = HostKVCache(GEO), HostKVCache(GEO)
    src_data = _fill(src, 5)
    before = _fill(dst, 6)
    s_stage, d_stage = HostStaging(src), HostStaging(dst)
    _push(s_stage.layout, d_stage.layout, s_stage, d_stage, S_BLOCKS, D_BLOCKS, TOKENS)
    _check(src_data, before, whole_cache_to_host(dst), dst.layout, S_BLOCKS, D_BLOCKS)
