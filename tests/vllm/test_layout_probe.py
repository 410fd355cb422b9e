"""The layout probe on stand-in KV tensors (CPU torch tensors; a wrapper reports device type "neuron"),
shaped as vllm-neuron's and the CUDA backends declare them. No vLLM engine runs here.

Every layout is checked by address: for each (layer, kv, block, token, head) the layout's address must be
the address torch gives the same element of the stand-in tensor.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpush.platforms.vllm.cache_groups import cache_groups, group_of_layers, layout_groups
from kvpush.platforms.vllm.layout_probe import (
    CPU_VIEW,
    FLASH_ATTN_5D,
    NEURON_CUSTOM,
    RFC_VIEW,
    CacheFeatures,
    KVCacheDeclaration,
    declaration_from_backend,
    features_from_vllm,
    probe_layout,
)
from kvpush.platforms.vllm.probe import declared_layout, model_tag
from kvpush.protocol.layout import KVLayout, LayoutError


class NeuronStandInTensor:
    """A CPU tensor that reports torch device `neuron:0`, as vllm-neuron's KV tensors do."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.device = SimpleNamespace(type="neuron", index=0)
        self.shape = t.shape

    def __getattr__(self, name: str) -> Any:
        return getattr(self.t, name)


class NeuronCustomBackend:
    """Declares what vllm-neuron's CUSTOM backend declares (VN vllm_neuron/vllm/attention/attn.py)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        return (2, num_blocks, num_kv_heads, block_size, head_size)


class FlashAttnBackend:
    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class FlashInferHNDBackend:
    """Blocks outermost, K/V inside the block, declared NHD shape stored HND through the stride order."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 3, 2, 4)


def _addr(t: torch.Tensor, index: tuple[int, ...]) -> int:
    return int(t[index].data_ptr())


def _check_addresses(layout: KVLayout, tensors: list[torch.Tensor], index_of: Any) -> None:
    """layout.address == torch's address of the same element, over a spread of positions."""
    for layer, t in enumerate(tensors):
        for kv, block, token, head in itertools.product(
            range(layout.kv_per_layer),
            {0, 1, layout.num_blocks - 1},
            {0, layout.block_size - 1},
            {0, layout.num_kv_heads - 1},
        ):
            assert layout.address(layer, kv, block, token, head) == _addr(t, index_of(kv, block, token, head))


def _neuron_caches(layers: int, blocks: int, heads: int, tokens: int, dim: int) -> list[torch.Tensor]:
    return [torch.zeros(2, blocks, heads, tokens, dim, dtype=torch.bfloat16) for _ in range(layers)]


def test_vllm_neuron_cache_is_read_as_declared_hnd_two_planes_per_layer() -> None:
    tensors = _neuron_caches(3, 64, 2, 32, 128)  # TP 8 of 16 KV heads: 2 per rank, block size 32
    caches = {f"layers.{i}.attn": NeuronStandInTensor(t) for i, t in enumerate(tensors)}
    declared = declaration_from_backend(NeuronCustomBackend)
    assert declared == NEURON_CUSTOM
    probed = probe_layout(caches, block_size=32, total_kv_heads=16, tp_rank=3, tp_size=8, declared=declared)
    lay = probed.layout
    assert probed.device_type == "neuron" and probed.blocks_per_vllm_block == 1
    assert (lay.token_order, lay.kv_per_layer, lay.num_kv_heads, lay.block_size, lay.head_dim) == (
        "HND",
        2,
        2,
        32,
        128,
    )
    assert lay.block_stride == 2 * 32 * 128 * 2 == lay.block_bytes
    assert len(lay.regions) == 3  # one region per layer tensor, K and V planes inside it
    assert all(r.nbytes == 2 * 64 * lay.block_bytes for r in lay.regions)
    assert lay.plane(1, 1).offset == 64 * lay.block_bytes
    _check_addresses(lay, tensors, lambda kv, b, n, h: (kv, b, h, n))


def test_ambiguous_heads_equal_block_size_is_refused_without_a_declaration() -> None:
    """32 heads per rank and block size 32: (2,B,H,N,D) and (2,B,N,H,D) both fit. The old probe took it as
    NHD silently (moving the wrong bytes for vllm-neuron); now it is refused, and the declaration decides.
    (Tensors on a Neuron device are declared by their device: tests/backends/test_neuron_findings.py.)"""
    tensors = _neuron_caches(2, 8, 32, 32, 16)
    caches = {f"l{i}": t for i, t in enumerate(tensors)}  # a device that implies no declaration
    kw: dict[str, Any] = dict(block_size=32, total_kv_heads=32, tp_rank=0, tp_size=1)
    assert declared_layout("", None, caches["l0"]) is None  # the connector's path: no backend class
    with pytest.raises(LayoutError, match="reads as .* HND .* NHD"):
        probe_layout(caches, declared=None, **kw)
    with pytest.raises(LayoutError, match="declaration"):
        probe_layout(caches, **kw)
    hnd = probe_layout(caches, declared=NEURON_CUSTOM, **kw).layout
    assert hnd.token_order == "HND"
    _check_addresses(hnd, tensors, lambda kv, b, n, h: (kv, b, h, n))
    nhd = probe_layout(caches, declared=FLASH_ATTN_5D, **kw).layout
    assert nhd.token_order == "NHD"
    _check_addresses(nhd, tensors, lambda kv, b, n, h: (kv, b, n, h))


def test_5d_without_a_declaration_reads_vllm_neuron_where_one_reading_fits() -> None:
    """The issue's stand-in: shape (2,64,2,32,128), TP 8 of 16 KV heads; it used to raise "32 heads per rank"."""
    tensors = _neuron_caches(2, 64, 2, 32, 128)
    caches = {f"l{i}": NeuronStandInTensor(t) for i, t in enumerate(tensors)}
    declared = declared_layout("", None, caches["l0"])  # the connector's path: no backend class
    probed = probe_layout(
        caches, block_size=32, total_kv_heads=16, tp_rank=0, tp_size=8, model_tag="m", declared=declared
    )
    lay, ratio = probed.layout, probed.blocks_per_vllm_block
    assert lay.token_order == "HND" and ratio == 1 and lay.model_tag == "m"
    _check_addresses(lay, tensors, lambda kv, b, n, h: (kv, b, h, n))


def test_flash_attention_5d_nhd_and_kernel_block_ratio() -> None:
    tensors = [torch.zeros(2, 10, 16, 4, 64, dtype=torch.float16) for _ in range(2)]
    declared = declaration_from_backend(FlashAttnBackend)
    assert declared == FLASH_ATTN_5D
    probed = probe_layout(
        {f"l{i}": t for i, t in enumerate(tensors)},
        block_size=32,
        total_kv_heads=8,
        tp_rank=1,
        tp_size=2,
        declared=declared,
    )
    assert probed.layout.token_order == "NHD" and probed.blocks_per_vllm_block == 2
    assert probed.device_type == "cpu" and probed.layout.regions[0].device_id == 0
    _check_addresses(probed.layout, tensors, lambda kv, b, n, h: (kv, b, n, h))


def test_flashinfer_blocks_outermost_with_declared_hnd_stride_order() -> None:
    physical = [torch.zeros(6, 2, 4, 16, 32, dtype=torch.float16) for _ in range(2)]  # (B, 2, H, N, D)
    tensors = [p.permute(0, 1, 3, 2, 4) for p in physical]  # logical (B, 2, N, H, D), as vLLM hands it over
    declared = declaration_from_backend(FlashInferHNDBackend)
    assert declared is not None and declared.stride_order == (0, 1, 3, 2, 4)
    lay = probe_layout(
        {f"l{i}": t for i, t in enumerate(tensors)},
        block_size=16,
        total_kv_heads=4,
        tp_rank=0,
        tp_size=1,
        declared=declared,
    ).layout
    assert lay.token_order == "HND"
    assert lay.block_stride == 2 * lay.block_bytes and lay.plane(0, 1).offset == lay.block_bytes
    _check_addresses(lay, tensors, lambda kv, b, n, h: (b, kv, n, h))
    wrong = KVCacheDeclaration("FLASHINFER", declared.axes, stride_order=(0, 1, 2, 3, 4))
    with pytest.raises(LayoutError, match="declared stride order"):
        probe_layout(
            {"l0": tensors[0]}, block_size=16, total_kv_heads=4, tp_rank=0, tp_size=1, declared=wrong
        )


@pytest.mark.parametrize("physical", ["LBHNC", "LBNHC"])
def test_rfc_view_4d_reads_the_order_from_strides(physical: str) -> None:
    blocks, heads, tokens, content = 5, 2, 16, 2 * 64
    if physical == "LBHNC":
        t = torch.zeros(blocks, heads, tokens, content, dtype=torch.float16)
    else:
        t = torch.zeros(blocks, tokens, heads, content, dtype=torch.float16).permute(0, 2, 1, 3)
    declared = declared_layout("", None, t)  # the connector's path: a 4D tensor is the RFC view
    assert declared == RFC_VIEW
    probed = probe_layout({"l0": t}, block_size=16, total_kv_heads=4, tp_rank=1, tp_size=2, declared=declared)
    lay, ratio = probed.layout, probed.blocks_per_vllm_block
    assert lay.token_order == ("HND" if physical == "LBHNC" else "NHD") and lay.kv_per_layer == 1
    assert lay.head_dim == content and ratio == 1
    _check_addresses(lay, [t], lambda kv, b, n, h: (b, h, n))


def test_cpu_backend_view_splits_content_into_virtual_heads() -> None:
    t = torch.zeros(4, 2, 16, 2 * 32, dtype=torch.bfloat16)
    lay = probe_layout(
        {"l0": t}, block_size=16, total_kv_heads=2, tp_rank=0, tp_size=1, declared=CPU_VIEW
    ).layout
    assert (lay.num_kv_heads, lay.head_dim, lay.token_order) == (4, 32, "HND")
    # K of head 1 is virtual head 2 and starts the head's [2N, C/2] slice
    assert lay.address(0, 0, 3, 0, 2) == int(t[3, 1].data_ptr())


def test_refused_caches_are_named() -> None:
    t = {"l0": torch.zeros(4, 2, 16, 64, dtype=torch.float16)}
    kw: dict[str, Any] = dict(block_size=16, total_kv_heads=2, tp_rank=0, tp_size=1)
    cases = {
        "sliding-window attention": CacheFeatures(sliding_window=4096),
        "decode context parallelism": CacheFeatures(dcp_size=2),
        "FP8-packed KV cache": CacheFeatures(fp8_packed_kv=True),
        "hybrid KV cache": CacheFeatures(num_kv_cache_groups=2),
    }
    for name, features in cases.items():
        with pytest.raises(LayoutError, match=name):
            probe_layout(t, features=features, **kw)
    probe_layout(t, features=CacheFeatures(kv_cache_dtype="fp8_e4m3"), **kw)  # plain FP8 bytes move as-is


def test_fp8_kv_moves_one_byte_per_element_and_its_dtype_and_scales_must_match() -> None:
    """vLLM keeps FP8 KV as uint8 (both formats): the probe sees 1-byte elements; the dtype name and the
    per-layer scales go into the model tag (compat hash), since neither is visible in the geometry."""
    t = torch.zeros(4, 2, 32, 2 * 64, dtype=torch.uint8)
    lay = probe_layout(
        {"l0": t}, block_size=32, total_kv_heads=2, tp_rank=0, tp_size=1, declared=CPU_VIEW
    ).layout
    assert (lay.dtype_size, lay.num_kv_heads, lay.head_dim, lay.block_bytes) == (1, 4, 64, 4 * 32 * 64)

    def cfg(kv: str, k_scale: float = 1.0) -> Any:
        layers = {n: SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=1.0) for n in ("a", "b")}
        return SimpleNamespace(
            model_config=SimpleNamespace(hf_config=SimpleNamespace(), dtype="float32"),
            cache_config=SimpleNamespace(cache_dtype=kv),
            compilation_config=SimpleNamespace(static_forward_context=layers),
        )

    tags = {kv: model_tag(cfg(kv), "", ["a", "b"]) for kv in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")}
    assert "kv=" not in tags["auto"] and len(set(tags.values())) == 4
    assert model_tag(cfg("fp8_e4m3"), "", ["a", "b"]) == tags["fp8_e4m3"]
    assert model_tag(cfg("fp8_e4m3", 0.5), "", ["a", "b"]) != tags["fp8_e4m3"]


def test_features_from_a_vllm_config_shaped_object() -> None:
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(get_sliding_window=lambda: 128),
        parallel_config=SimpleNamespace(decode_context_parallel_size=2),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        additional_config={"neuron_config": {"fp8_packed_kv": True}},
    )
    f = features_from_vllm(cfg, SimpleNamespace(kv_cache_groups=[1, 2]))
    assert f == CacheFeatures(128, 2, "auto", True, 2)
    assert features_from_vllm(SimpleNamespace()) == CacheFeatures()


def test_backend_declarations_that_cannot_be_used() -> None:
    class NxdiBackend:
        @staticmethod
        def get_name() -> str:
            return "NEURON"

        @staticmethod
        def get_kv_cache_shape(*_a: int) -> tuple:
            raise NotImplementedError

    class PackedBackend:
        @staticmethod
        def get_name() -> str:
            return "PACKED"

        @staticmethod
        def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
            return (num_blocks, block_size * num_kv_heads * head_size // 4)

    class RfcBackend:  # vLLM >= 0.32: no per-backend shape
        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

    with pytest.raises(LayoutError, match="NxDI"):
        declaration_from_backend(NxdiBackend)
    with pytest.raises(LayoutError, match="no meaning kvpush knows"):
        declaration_from_backend(PackedBackend)
    assert declaration_from_backend(RfcBackend) is None


def test_heads_mismatch_and_null_address() -> None:
    tensors = _neuron_caches(1, 4, 2, 32, 8)
    with pytest.raises(LayoutError, match=r"hold 2 heads per rank .*\(4 per rank\)"):
        probe_layout(
            {"l0": tensors[0]}, block_size=32, total_kv_heads=8, tp_rank=0, tp_size=2, declared=NEURON_CUSTOM
        )

    class Unmapped(NeuronStandInTensor):
        def data_ptr(self) -> int:
            return 0

    with pytest.raises(LayoutError, match="data_ptr\\(\\) 0"):
        probe_layout(
            {"l0": Unmapped(tensors[0])},
            block_size=32,
            total_kv_heads=2,
            tp_rank=0,
            tp_size=1,
            declared=NEURON_CUSTOM,
        )


def _spec(name: str, **fields: Any) -> Any:
    """A stand-in of a vLLM KV-cache spec: the probe reads its class name and attributes."""
    return type(name, (), fields)()


def _kv_cache_config(*groups: tuple[list[str], Any]) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec) for names, spec in groups]
    )


def test_cache_groups_read_kinds_and_windows_from_the_kv_cache_config() -> None:
    cfg = _kv_cache_config(
        (["l2", "l5"], _spec("FullAttentionSpec", num_kv_heads=2, head_size=64, sliding_window=None)),
        (["l0", "l3"], _spec("SlidingWindowSpec", num_kv_heads=2, head_size=64, sliding_window=64)),
        (["l1", "l4"], _spec("SlidingWindowSpec", num_kv_heads=2, head_size=64, sliding_window=64)),
    )
    groups = cache_groups(cfg)
    assert [(g.kind, g.window) for g in groups] == [("full", 0), ("window", 64), ("window", 64)]
    assert group_of_layers(groups, ["l0", "l1", "l2", "l3", "l4", "l5"]) == (1, 2, 0, 1, 2, 0)
    with pytest.raises(LayoutError, match="belong to no KV-cache group"):
        group_of_layers(groups, ["l0", "l9"])
    # window layers merged into a full-attention group (hybrid manager off) keep every block: full
    merged = cache_groups(_kv_cache_config((["l0"], _spec("FullAttentionSpec", sliding_window=64))))
    assert (merged[0].kind, merged[0].window) == ("full", 0)
    mla = cache_groups(_kv_cache_config((["l0"], _spec("MLAAttentionSpec", num_kv_heads=1, head_size=576))))
    assert (mla[0].kind, mla[0].num_kv_heads, mla[0].head_size) == ("mla", 1, 576)
    assert cache_groups(None) == ()


def test_groups_and_windows_move_and_unknown_kinds_are_refused_by_group() -> None:
    """With vLLM's KV-cache config the groups are known: full and window groups move (one table each),
    a group of another kind is refused naming it; without the config a window or several groups are
    refused (nothing says which layers they hold)."""
    cfg = SimpleNamespace(model_config=SimpleNamespace(get_sliding_window=lambda: 64))
    hybrid = _kv_cache_config(
        (["l2"], _spec("FullAttentionSpec", num_kv_heads=2, head_size=64)),
        (["l0"], _spec("SlidingWindowSpec", num_kv_heads=2, head_size=64, sliding_window=64)),
        (["l1"], _spec("SlidingWindowSpec", num_kv_heads=2, head_size=64, sliding_window=64)),
    )
    f = features_from_vllm(cfg, hybrid)
    assert f.num_kv_cache_groups == 3 and not f.mla
    assert [g.describe() for g in f.groups] == ["full attention", "window 64", "window 64"]
    f.refuse_unsupported()
    mamba = _kv_cache_config(
        (["l0"], _spec("FullAttentionSpec")), (["l1"], _spec("MambaSpec", num_kv_heads=0, head_size=0))
    )
    with pytest.raises(LayoutError, match=r"KV-cache group 1 is a MambaSpec, a cache kvpush does not know"):
        features_from_vllm(SimpleNamespace(), mamba).refuse_unsupported()
    with pytest.raises(LayoutError, match=r"sliding-window attention \(window 64\) without vLLM's KV-cache"):
        features_from_vllm(cfg).refuse_unsupported()
    # a model config window whose layers vLLM keeps in a full-attention group is not refused
    full = _kv_cache_config((["l0"], _spec("FullAttentionSpec", sliding_window=64)))
    features_from_vllm(cfg, full).refuse_unsupported()


def test_mla_latent_is_one_replicated_head_whatever_the_model_config_says() -> None:
    """vLLM >= 0.32 hands the CPU_MLA cache as a [B, 1, N, 576] view. The model config names 4 KV heads;
    the KV-cache config's MLA group makes it one latent head, on every TP rank (replicated)."""
    mla = _kv_cache_config((["l0", "l1"], _spec("MLAAttentionSpec", num_kv_heads=1, head_size=576)))
    features = features_from_vllm(SimpleNamespace(), mla)
    assert features.mla
    caches = {f"l{i}": torch.zeros(6, 1, 16, 576, dtype=torch.float32) for i in range(2)}
    declared = declared_layout("CPU_MLA", None, caches["l0"])
    assert declared == RFC_VIEW
    with pytest.raises(LayoutError, match="hold 1 heads per rank"):  # what happened before: 4 heads
        probe_layout(caches, block_size=16, total_kv_heads=4, tp_rank=0, tp_size=1, declared=declared)
    for tp_rank, tp_size in ((0, 1), (1, 2)):
        lay = probe_layout(
            caches, block_size=16, total_kv_heads=1, tp_rank=tp_rank, tp_size=tp_size, declared=declared
        ).layout
        assert (lay.num_kv_heads, lay.total_kv_heads, lay.kv_per_layer, lay.head_dim) == (1, 1, 1, 576)
        assert lay.dtype_size == 4 and not lay.atomic_blocks
        _check_addresses(lay, list(caches.values()), lambda kv, b, n, h: (b, h, n))


def test_layout_groups_keep_window_minus_one_tokens_and_leave_one_full_group_as_before() -> None:
    full = _spec("FullAttentionSpec", num_kv_heads=2, head_size=64)
    window = _spec("SlidingWindowSpec", num_kv_heads=2, head_size=64, sliding_window=64)
    hybrid = cache_groups(_kv_cache_config((["l2"], full), (["l0", "l3"], window), (["l1"], window)))
    assert layout_groups(hybrid, ["l0", "l1", "l2", "l3"]) == ((1, 2, 0, 1), (0, 63, 63))
    assert layout_groups(cache_groups(_kv_cache_config((["l0", "l1"], window))), ["l0", "l1"]) == (
        (0, 0),
        (63,),
    )
    assert layout_groups(cache_groups(_kv_cache_config((["l0"], full))), ["l0"]) == ((), ())
    assert layout_groups((), ["l0"]) == ((), ())
    one = _spec("SlidingWindowSpec", sliding_window=1)
    with pytest.raises(LayoutError, match="sliding window 1"):
        layout_groups(cache_groups(_kv_cache_config((["l0"], full), (["l1"], one))), ["l0", "l1"])
