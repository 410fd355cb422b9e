"""The Neuron path's findings (issue 18), each shown through the libnrt stand-in (a C library written for
these tests, NOT the Neuron runtime) or stand-in KV tensors that report device type "neuron":

* the "runtime initialised" check asks an API that needs nrt_init (the count getters do not);
* the connector start refuses, by name, a missing HBM mapping, SHM transfer on one host and a runtime
  not initialised, and a hybrid cache through the connector's kv_cache_config;
* Neuron tensors are read as vLLM Neuron declares them (HND) by their device, also when heads per rank
  equal the block size;
* the KV-written barrier returns only after an execution in flight that writes the KV is done.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvpush.backends import select
from kvpush.backends.neuron import (
    NeuronKVCache,
    NeuronPrerequisiteError,
    NeuronRuntime,
    check_neuron_connector,
    mapped_libnrt,
    neuron_kv_written_barrier,
)
from kvpush.config import KVPushConfig
from kvpush.platforms.vllm.layout_probe import NEURON_CUSTOM, probe_layout
from kvpush.platforms.vllm.params import ConnectorSettings, PrefillAddressSpec
from kvpush.platforms.vllm.probe import declared_layout, probe_kv_caches, shares_host
from kvpush.protocol.layout import KVLayout, LayoutError, Plane, Region

Loader = Callable[..., NeuronRuntime]
GEO = KVLayout(
    num_layers=2, block_size=16, num_blocks=8, total_kv_heads=2, head_dim=32, dtype_size=2, token_order="HND"
)
ENV_OK = {"NEURON_RT_MAP_HBM": "1", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


class NeuronTensor:
    """A CPU tensor that reports torch device `neuron:0`, as vLLM Neuron's KV tensors do."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.device = SimpleNamespace(type="neuron", index=0)
        self.shape = t.shape

    def __getattr__(self, name: str) -> Any:
        return getattr(self.t, name)


# ---- the initialisation check --------------------------------------------------------------------------


@pytest.mark.parametrize("build", ["current", "old"])
def test_initialised_asks_an_api_that_needs_nrt_init(
    load_standin: Loader, monkeypatch: pytest.MonkeyPatch, build: str
) -> None:
    """nrt.h: nrt_get_visible_nc_count "can be called before nrt_init()" - it answers either way, so a
    check built on it never fires. The old runtime build lacks nrt_get_vnc_memory_stats: the one-byte
    host tensor allocation answers there."""
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
    rt = load_standin(build)
    n = ctypes.c_uint32(0)
    assert rt.lib.nrt_get_visible_nc_count(ctypes.byref(n)) == 0 and n.value == 8  # before nrt_init
    assert rt.has_symbol("nrt_get_vnc_memory_stats") == (build == "current")
    assert not rt.initialised()
    with pytest.raises(NeuronPrerequisiteError, match="not initialised.*before creating the NIXL agent"):
        check_neuron_connector((), single_host=False, runtime=rt, environ=ENV_OK)
    rt.lib.nrt_init(0, b"", b"")
    assert rt.initialised()
    rt.lib.nrt_close()
    assert not rt.initialised()  # NRT_CLOSED counts as "not initialised" too


def test_the_runtime_vllm_neuron_mapped_is_the_one_asked() -> None:
    """A second libnrt copy loaded from another path would be a runtime nobody initialised."""
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 2 /venv/lib/python3.12/site-packages/libtorch_neuronx_lite/lib/libnrt.so.1\n"
        "7f40-7f50 rw-p 00000000 00:00 0\n"
    )
    assert mapped_libnrt(maps) == "/venv/lib/python3.12/site-packages/libtorch_neuronx_lite/lib/libnrt.so.1"
    assert mapped_libnrt("7f00-7f10 r-xp 00000000 08:01 1 /tmp/libnrt-standin.so\n") is None
    assert mapped_libnrt("") is None


# ---- prerequisites at connector start --------------------------------------------------------------------


def _settings(role: str, host: str) -> ConnectorSettings:
    if role == "prefill":
        cfg = KVPushConfig.from_mapping(dict(engine_id="P", host=host, port=5600))
        return ConnectorSettings(role, cfg, block_size=16, tp_size=1, pp_size=1)
    cfg = KVPushConfig.from_mapping(dict(engine_id="D"))
    spec = (PrefillAddressSpec("P", host, 5600),)
    return ConnectorSettings(role, cfg, block_size=16, tp_size=1, pp_size=1, prefill_addresses=spec)


def test_shared_host_is_read_from_the_connector_config() -> None:
    assert shares_host(_settings("prefill", "127.0.0.1"))
    assert shares_host(_settings("decode", "localhost"))
    assert not shares_host(_settings("decode", "192.0.2.7"))  # TEST-NET-1: never this host
    assert not shares_host(_settings("prefill", "192.0.2.7"))


def _vllm_config(groups: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={}),
        model_config=SimpleNamespace(
            get_total_num_kv_heads=lambda: 2,
            hf_config=SimpleNamespace(architectures=["Stand-in"], num_hidden_layers=2),
            dtype="bfloat16",
        ),
        kv_transfer_config=SimpleNamespace(kv_buffer_device="cuda"),
    )


class _NoTorchNeuronCache(NeuronKVCache):
    """NeuronKVCache.wrap without torch device copies (the stand-in tensors live on the CPU)."""

    @classmethod
    def wrap(cls, layout: KVLayout, tensors: list[Any]) -> NeuronKVCache:
        return cls(layout, lambda r, o, b: None, lambda r, o, b: None, keepalive=tensors)


@pytest.fixture
def neuron_kv(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(select, "NeuronKVCache", _NoTorchNeuronCache)
    return {
        f"layers.{i}.self_attn": NeuronTensor(torch.zeros(2, 8, 2, 16, 32, dtype=torch.bfloat16))
        for i in range(2)
    }


def test_the_connector_start_refuses_neuron_prerequisites_by_name(
    neuron_kv: dict[str, Any],
    load_standin: Loader,
    standin_builds: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """probe_kv_caches is what the vLLM worker runs at register_kv_caches, before the NIXL agent exists."""
    monkeypatch.setenv("KVPUSH_LIBNRT", str(standin_builds["current"]))
    monkeypatch.delenv("NEURON_RT_MAP_HBM", raising=False)
    monkeypatch.delenv("FI_EFA_ENABLE_SHM_TRANSFER", raising=False)
    one_host = _settings("decode", "127.0.0.1")
    with pytest.raises(NeuronPrerequisiteError, match="NEURON_RT_MAP_HBM is None in the vLLM worker"):
        probe_kv_caches(one_host, _vllm_config(), neuron_kv)
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
    with pytest.raises(NeuronPrerequisiteError, match="share this host: set FI_EFA_ENABLE_SHM_TRANSFER=0"):
        probe_kv_caches(one_host, _vllm_config(), neuron_kv)
    monkeypatch.setenv("FI_EFA_ENABLE_SHM_TRANSFER", "0")
    with pytest.raises(NeuronPrerequisiteError, match="runtime is not initialised"):
        probe_kv_caches(one_host, _vllm_config(), neuron_kv)  # the stand-in as loaded: nrt_init not run
    rt = load_standin()
    rt.lib.nrt_init(0, b"", b"")
    monkeypatch.setenv("KVPUSH_LIBNRT", rt.path)
    probed = probe_kv_caches(one_host, _vllm_config(), neuron_kv)
    assert probed.mem_type == "VRAM" and probed.layout.token_order == "HND"
    monkeypatch.delenv("FI_EFA_ENABLE_SHM_TRANSFER")
    probe_kv_caches(_settings("decode", "192.0.2.7"), _vllm_config(), neuron_kv)  # two hosts: no SHM rule


def test_hybrid_groups_are_refused_with_the_connectors_kv_cache_config(
    neuron_kv: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvpush.platforms.vllm.probe.check_neuron_connector", lambda *a, **k: None)
    settings = _settings("prefill", "192.0.2.7")
    hybrid = SimpleNamespace(kv_cache_groups=[object(), object()])
    with pytest.raises(LayoutError, match=r"hybrid KV cache \(2 KV cache groups, 2 without a spec"):
        probe_kv_caches(settings, _vllm_config(), neuron_kv, hybrid)
    probe_kv_caches(settings, _vllm_config(), neuron_kv, SimpleNamespace(kv_cache_groups=[object()]))


# ---- layout by device ------------------------------------------------------------------------------------


def test_neuron_tensors_are_hnd_by_device_even_when_heads_equal_the_block_size() -> None:
    """32 KV heads per rank, block 32: the shape reads both ways; the device says vLLM Neuron's HND."""
    tensors = [torch.zeros(2, 4, 32, 32, 8, dtype=torch.bfloat16) for _ in range(2)]
    caches = {f"l{i}": NeuronTensor(t) for i, t in enumerate(tensors)}
    assert declared_layout("", None, caches["l0"]) == NEURON_CUSTOM  # no backend class on vLLM Neuron
    lay = probe_layout(caches, block_size=32, total_kv_heads=32, tp_rank=0, tp_size=1).layout
    assert lay.token_order == "HND" and lay.num_kv_heads == 32 and lay.block_size == 32
    t = tensors[1]
    assert lay.address(1, 1, 3, 5, 7) == int(t[1, 3, 7, 5].data_ptr())  # (kv, block, head, token)
    privateuse = NeuronTensor(tensors[0])
    privateuse.device = SimpleNamespace(type="privateuseone", index=0)
    assert declared_layout("", None, privateuse) == NEURON_CUSTOM


# ---- the KV-written barrier ------------------------------------------------------------------------------


def test_the_barrier_returns_after_the_execution_writing_the_kv(
    load_standin: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ordering contract: a barrier built after a step was submitted returns only once the step's
    writes to the KV are done, so the WRITE that follows reads the new bytes. The stand-in's execution
    writes after 300 ms on its own thread; memory read directly (as NIXL's DMA reads HBM) is stale until
    then."""
    monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
    rt = load_standin()
    rt.lib.nrt_init(0, b"", b"")
    cache = NeuronKVCache.allocate(GEO, rt)
    try:
        for h, r in zip(cache.handles, cache.regions, strict=True):
            assert rt.lib.standin_execute_async(ctypes.c_void_p(h), 0, r.nbytes, 0x5A, 300_000) == 0
        submitted = time.monotonic()
        barrier = cache.kv_written_barrier()  # on the engine thread, at hand-off: must not wait
        assert barrier is not None and time.monotonic() - submitted < 0.2
        assert all(ctypes.string_at(r.addr, 64) == bytes(64) for r in cache.regions)  # not written yet
        barrier()  # on the push thread, before the WRITE is posted
        assert time.monotonic() - submitted >= 0.29
        for r in cache.regions:
            got = np.frombuffer(ctypes.string_at(r.addr, r.nbytes), dtype=np.uint8)
            assert bool((got == 0x5A).all())
    finally:
        cache.free()


def test_engine_tensors_get_a_read_back_barrier_without_torch_neuron() -> None:
    """torch has no `torch.neuron.synchronize` (and no Neuron event) to build a barrier on; the read-back
    needs only the tensors' own device -> host copy."""
    tensors = [torch.arange(2 * 4 * 2 * 16 * 8, dtype=torch.int16).reshape(2, 4, 2, 16, 8) for _ in range(2)]
    regions = tuple(Region(int(t.data_ptr()), t.nbytes, 0) for t in tensors)
    lay = KVLayout(2, 16, 4, 2, 8, 2, token_order="HND")
    planes = tuple(
        Plane(layer, kv, layer, kv * tensors[0].stride(0) * 2) for layer in range(2) for kv in range(2)
    )
    cache = NeuronKVCache.wrap(lay.with_memory(regions, planes), tensors)
    barrier = cache.kv_written_barrier()
    assert callable(barrier)
    barrier()
    with pytest.raises(NeuronPrerequisiteError, match="at least one KV region"):
        neuron_kv_written_barrier([])
