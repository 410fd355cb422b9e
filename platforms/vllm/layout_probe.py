"""Describe vLLM's registered KV cache tensors as a kvpush KVLayout, from what the attention backend
*declares* about them.

Why a declaration: two backends can hand over tensors of the same shape whose dims mean different things.
vllm-neuron's backend (`CUSTOM`) declares `(2, num_blocks, num_kv_heads, block_size, head_size)` (HND:
tokens contiguous per head); the older CUDA backends declare `(2, num_blocks, block_size, num_kv_heads,
head_size)` (NHD). With 32 heads per rank and block size 32 both readings fit the tensor, and guessing
moves the wrong bytes. So the meaning of every dim comes from the backend:

* `declaration_from_backend(backend_cls)` calls `get_kv_cache_shape` with four distinct sizes and reads
  which dim is which from the answer (plus `get_kv_cache_stride_order`, where present, as a cross-check
  of the tensors' strides). vllm-neuron and vLLM < 0.32 backends declare this way.
* vllm-neuron's attention lives in its modelling code, so vLLM's per-layer lookup finds no backend class
  there: Neuron tensors (device type `neuron` / `privateuseone`) take vllm-neuron's declaration by their
  device (`declaration_for_device`), never by their shape.
* vLLM >= 0.32 (RFC #42082) has no per-backend shape: every per-layer view is the logical 4D
  `[B, H, N, C]` (C = K then V of one (head, token)), with the physical order in its strides (the CPU
  backend uses LBHNC, FlashInfer LBHNC/BLHNC). `RFC_VIEW` is that declaration.

The tensors' byte strides then give the physical order (NHD or HND) and every plane's address. Blocks must
be dense inside (a block's heads x tokens units contiguous in one of the two orders); anything else raises
LayoutError naming the tensor, its shape and strides.

KV-cache groups (full attention, sliding window, MLA) come from vLLM's KV-cache config (cache_groups.py).
Caches kvpush cannot move correctly are refused by name (`CacheFeatures`): groups of kinds kvpush does not
know, a window or several groups without the KV-cache config that says which layers they hold, decode
context parallelism (DCP) and FP8-packed KV. An MLA cache is one latent "head" per token, whatever the
model config says of its KV heads.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvpush.backends.select import NEURON_DEVICE_TYPES
from kvpush.protocol.layout import KVLayout, LayoutError, Plane, Region

from .cache_groups import CacheGroup, cache_groups

Axis = Literal["kv", "block", "head", "token", "dim", "content"]
"""Meaning of one tensor dim: K/V plane index, block, KV head, token in block, head_size elements of one
of K or V ("dim"), or K and V of one (head, token) back to back ("content")."""


@dataclass(frozen=True)
class KVCacheDeclaration:
    """What an attention backend declares about its per-layer KV cache tensors.

    axes: the meaning of each tensor dim, in the tensor's (logical) dim order.
    stride_order: the backend's declared physical order (a permutation of dim indices, outermost first),
    checked against the tensors' strides when given.
    split_content: the backend reads a head's [N, C] block slice as [2N, C/2] (K rows, then V rows), as
    vLLM's CPU backend does; kvpush then sees 2H "virtual heads" of C/2 elements, head-major, and moves
    whole blocks (their interior order is the kernel's).
    """

    backend: str
    axes: tuple[Axis, ...]
    stride_order: tuple[int, ...] | None = None
    split_content: bool = False

    def __post_init__(self) -> None:
        need = {"block", "head", "token"}
        if not need <= set(self.axes) or len(set(self.axes)) != len(self.axes):
            raise LayoutError(
                f"backend {self.backend}: KV cache axes {self.axes} must name block, head and token once each"
            )
        if ("dim" in self.axes) == ("content" in self.axes):
            raise LayoutError(f"backend {self.backend}: KV cache axes {self.axes} need one of dim / content")
        if "content" in self.axes and "kv" in self.axes:
            raise LayoutError(
                f"backend {self.backend}: axes {self.axes} have both a kv plane and K+V content"
            )
        if self.stride_order is not None and sorted(self.stride_order) != list(range(len(self.axes))):
            raise LayoutError(
                f"backend {self.backend}: stride order {self.stride_order} is not a permutation "
                f"of {len(self.axes)} dims"
            )


# vLLM >= 0.32: one logical 4D view per layer (RFC #42082), whatever the backend.
RFC_VIEW = KVCacheDeclaration("vLLM>=0.32 per-layer view", ("block", "head", "token", "content"))
CPU_VIEW = KVCacheDeclaration("CPU_ATTN", ("block", "head", "token", "content"), split_content=True)
# What backends declare through get_kv_cache_shape, for callers that only have the backend's name.
NEURON_CUSTOM = KVCacheDeclaration("CUSTOM", ("kv", "block", "head", "token", "dim"))  # vllm-neuron, HND
FLASH_ATTN_5D = KVCacheDeclaration("FLASH_ATTN", ("kv", "block", "token", "head", "dim"))  # vLLM < 0.32, NHD

# Distinct sizes for probing get_kv_cache_shape: every value identifies one argument.
_PROBE = {"block": 101, "token": 16, "head": 3, "dim": 40}  # block size a multiple of 16 (FlashAttention)


def declaration_from_backend(backend: Any) -> KVCacheDeclaration | None:
    """The declaration of an attention backend class, or None when it declares no per-backend shape
    (vLLM >= 0.32, where the RFC view applies: the caller passes `RFC_VIEW` / `CPU_VIEW`).

    Calls `backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)` with distinct
    sizes; a dim of size 2 is the K/V plane index, 2 * head_size is K+V content.
    """
    name = _backend_name(backend)
    shape_fn = getattr(backend, "get_kv_cache_shape", None)
    if shape_fn is None:
        return None
    p = _PROBE
    try:
        shape = tuple(int(s) for s in shape_fn(p["block"], p["token"], p["head"], p["dim"]))
    except NotImplementedError as exc:
        raise LayoutError(
            f"attention backend {name} declares no KV cache shape (get_kv_cache_shape is not implemented: "
            "the NxDI-based vllm-neuron keeps KV inside the compiled model); kvpush cannot push it"
        ) from exc
    by_size: dict[int, Axis] = {
        2: "kv",
        p["block"]: "block",
        p["token"]: "token",
        p["head"]: "head",
        p["dim"]: "dim",
        2 * p["dim"]: "content",
    }
    axes: list[Axis] = []
    for s in shape:
        if s not in by_size:
            raise LayoutError(
                f"attention backend {name}: get_kv_cache_shape{(p['block'], p['token'], p['head'], p['dim'])}"
                f" returned {shape}; dim of size {s} has no meaning kvpush knows (packed or quantised cache?)"
            )
        axes.append(by_size[s])
    order_fn = getattr(backend, "get_kv_cache_stride_order", None)
    stride_order: tuple[int, ...] | None = None
    if order_fn is not None:
        try:
            stride_order = tuple(int(i) for i in order_fn())
        except (NotImplementedError, TypeError):
            stride_order = None
    return KVCacheDeclaration(name, tuple(axes), stride_order, split_content=name == "CPU_ATTN")


def declaration_for_device(device_type: str) -> KVCacheDeclaration | None:
    """What the tensors' device implies: on Neuron, vLLM Neuron's CUSTOM backend (asked directly where
    vllm_neuron imports, else its known declaration, `NEURON_CUSTOM`: (2, B, H, N, D), HND). vLLM
    Neuron's attention lives in its own modelling code, so the per-layer backend lookup finds none;
    the device then decides, never the tensor shape. None for every other device."""
    if device_type not in NEURON_DEVICE_TYPES:
        return None
    try:
        from vllm_neuron.vllm.attention.attn import NeuronAttentionBackend
    except ImportError:
        return NEURON_CUSTOM
    return declaration_from_backend(NeuronAttentionBackend) or NEURON_CUSTOM


def _backend_name(backend: Any) -> str:
    try:
        return str(backend.get_name())
    except (AttributeError, TypeError, NotImplementedError):
        return getattr(backend, "__name__", type(backend).__name__)


@dataclass(frozen=True)
class CacheFeatures:
    """Cache properties kvpush refuses until it handles them; read from the engine's config and, where
    vLLM passes one, its KV-cache config (`groups`: what vLLM really keeps, group by group)."""

    sliding_window: int | None = None
    dcp_size: int = 1
    kv_cache_dtype: str = "auto"
    fp8_packed_kv: bool = False
    num_kv_cache_groups: int = 1
    groups: tuple[CacheGroup, ...] = ()
    mla: bool = False  # the cache holds one latent per token (vLLM's use_mla / an MLA group)

    def refuse_unsupported(self) -> None:
        reasons = []
        # Window and full-attention groups, one or several, move (cache_groups.layout_groups); without
        # vLLM's KV-cache config nothing says which layers a model's window applies to.
        if self.sliding_window and not self.groups:
            reasons.append(
                f"sliding-window attention (window {self.sliding_window}) without vLLM's KV-cache config: "
                "which layers and blocks the window holds is unknown"
            )
        for i, g in enumerate(self.groups):
            if g.kind == "other":
                reasons.append(f"KV-cache group {i} is a {g.spec}, a cache kvpush does not know")
        if self.dcp_size > 1:
            reasons.append(f"decode context parallelism (DCP size {self.dcp_size}): KV is split by sequence")
        if self.fp8_packed_kv or "packed" in self.kv_cache_dtype.lower():
            reasons.append(
                f"FP8-packed KV cache ({self.kv_cache_dtype}): a swizzled layout, not tokens x heads"
            )
        if self.num_kv_cache_groups > len(self.groups) > 0 or (
            self.num_kv_cache_groups > 1 and not self.groups
        ):
            reasons.append(
                f"hybrid KV cache ({self.num_kv_cache_groups} KV cache groups, "
                f"{self.num_kv_cache_groups - len(self.groups)} without a spec to read)"
            )
        if reasons:
            raise LayoutError("kvpush does not support this KV cache yet: " + "; ".join(reasons))


def features_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> CacheFeatures:
    """CacheFeatures from a VllmConfig and the connector's KVCacheConfig (attributes read defensively:
    vLLM versions and vllm-neuron differ). The KV-cache config, where given, decides groups, windows and
    MLA; the model config's window counts only without one."""
    model = getattr(vllm_config, "model_config", None)
    get_window = getattr(model, "get_sliding_window", None)
    window = get_window() if callable(get_window) else None
    parallel = getattr(vllm_config, "parallel_config", None)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    cache = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cache, "cache_dtype", "auto") or "auto")
    extra = getattr(vllm_config, "additional_config", None) or {}
    neuron = extra.get("neuron_config", {}) if isinstance(extra, Mapping) else {}
    packed = bool(neuron.get("fp8_packed_kv", False)) if isinstance(neuron, Mapping) else False
    groups = cache_groups(kv_cache_config)
    count = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None]) if kv_cache_config else 1
    mla = any(g.kind == "mla" for g in groups) or (not groups and getattr(model, "use_mla", False) is True)
    return CacheFeatures(
        sliding_window=int(window) if window else None,
        dcp_size=dcp,
        kv_cache_dtype=dtype,
        fp8_packed_kv=packed,
        num_kv_cache_groups=count,
        groups=groups,
        mla=mla,
    )


@dataclass(frozen=True)
class ProbedLayout:
    """What the probe found: the layout, kernel blocks per vLLM block, and the declaration used."""

    layout: KVLayout
    blocks_per_vllm_block: int
    declaration: KVCacheDeclaration
    device_type: str  # the tensors' torch device type: "cpu", "cuda", "neuron" (or "privateuseone")


def _storage_span(t: Any) -> tuple[int, int]:
    st = t.untyped_storage()
    return int(st.data_ptr()), int(st.nbytes())


def _order(h_stride: int, n_stride: int, heads: int, tokens: int, unit: int, what: str) -> str:
    if (tokens == 1 or n_stride == unit) and (heads == 1 or h_stride == tokens * unit):
        return "HND"
    if (heads == 1 or h_stride == unit) and (tokens == 1 or n_stride == heads * unit):
        return "NHD"
    raise LayoutError(
        f"{what} is not dense inside a block; kvpush needs each block's heads x tokens units contiguous"
    )


def _undeclared_5d(shape: tuple[int, ...], heads_per_rank: int, name: str) -> KVCacheDeclaration:
    """A 5D [2, B, ?, ?, D] tensor with no declaration: accepted only where exactly one reading fits the
    model's heads per rank; heads == tokens (both readings fit) is refused."""
    a, b = shape[2], shape[3]
    if a == heads_per_rank and b == heads_per_rank:
        raise LayoutError(
            f"KV cache tensor {name} has shape {shape}: with {heads_per_rank} KV heads per rank and a kernel "
            f"block of {b} tokens it reads as (2, B, H, N, D) HND (vllm-neuron) and as (2, B, N, H, D) NHD "
            "(FlashAttention) alike; pass the attention backend's declaration (declaration_from_backend)"
        )
    if b == heads_per_rank:
        return FLASH_ATTN_5D
    if a == heads_per_rank:
        return NEURON_CUSTOM
    raise LayoutError(
        f"KV cache tensor {name} has shape {shape}; neither dim 2 nor dim 3 holds the {heads_per_rank} KV "
        "heads per rank the model has"
    )


def probe_layout(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    total_kv_heads: int,
    tp_rank: int,
    tp_size: int,
    model_tag: str = "",
    declared: KVCacheDeclaration | None = None,
    features: CacheFeatures | None = None,
) -> ProbedLayout:
    """The layout of one rank's vLLM KV cache tensors (layers in the order vLLM registered them).

    declared: the attention backend's declaration (`declaration_from_backend(backend_cls)`, or
    `RFC_VIEW` / `CPU_VIEW` on vLLM >= 0.32). Without one, Neuron tensors are read as vLLM Neuron
    declares them (`declaration_for_device`), other 4D tensors as the RFC view and other 5D tensors only
    where a single reading fits the head count (never silently NHD).
    features: refused cache properties (`features_from_vllm(vllm_config, kv_cache_config)`).
    """
    (features or CacheFeatures()).refuse_unsupported()
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    names = list(kv_caches)
    first = kv_caches[names[0]]
    elem = int(first.element_size())
    device_type = str(first.device.type)
    split = declared.split_content if declared is not None else False
    heads_model = total_kv_heads * (2 if split else 1)
    probe_heads = KVLayout(1, 1, 1, heads_model, 1, 1, tp_rank, tp_size).num_kv_heads
    if declared is None:
        declared = declaration_for_device(device_type)
    if declared is None:
        if first.dim() == 4:
            declared = RFC_VIEW
        elif first.dim() == 5 and int(first.shape[0]) == 2:
            declared = _undeclared_5d(tuple(int(s) for s in first.shape), probe_heads, names[0])
        else:
            raise LayoutError(
                f"KV cache tensor {names[0]} has shape {tuple(first.shape)} and no backend declaration; "
                "kvpush understands [B, H, N, C] views and declared 5D tensors"
            )
    if split and tp_size > total_kv_heads:
        raise LayoutError("kvpush: TP larger than the KV head count is not supported with the CPU backend")
    regions: list[Region] = []
    region_index: dict[int, int] = {}
    planes: list[Plane] = []
    geometry: tuple[int, ...] | None = None
    order = "NHD"
    axes = declared.axes
    for layer, name in enumerate(names):
        t = kv_caches[name]
        shape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) * elem for s in t.stride())
        what = f"KV cache tensor {name} (shape {shape}, byte strides {strides}, backend {declared.backend})"
        if len(shape) != len(axes):
            raise LayoutError(f"{what} has {len(shape)} dims but the backend declares {len(axes)}: {axes}")
        if str(t.device.type) != device_type:
            raise LayoutError(f"{what} is on {t.device.type}, the first layer on {device_type}")
        dim = {ax: shape[i] for i, ax in enumerate(axes)}
        stride = {ax: strides[i] for i, ax in enumerate(axes)}
        if "kv" in dim and dim["kv"] != 2:
            raise LayoutError(f"{what}: the K/V dim has size {dim['kv']}, not 2")
        _check_stride_order(declared, shape, strides, what)
        inner: Axis = "content" if "content" in dim else "dim"
        if dim[inner] > 1 and stride[inner] != elem:
            raise LayoutError(f"{what}: the last dim ({inner}) is not contiguous")
        heads, tokens, content = dim["head"], dim["token"], dim[inner]
        unit = content * elem
        order = _order(stride["head"], stride["token"], heads, tokens, unit, what)
        if split:
            if order != "HND" or (tokens > 1 and stride["token"] != unit) or content % 2:
                raise LayoutError(
                    f"{what} is not the head-major dense block the CPU backend reads as [2N, C/2]"
                )
            heads, content = 2 * heads, content // 2
        base, nbytes = _storage_span(t)
        ptr = int(t.data_ptr())
        if ptr == 0:
            raise LayoutError(f"{what} has data_ptr() 0: the device memory has no address to register")
        if base not in region_index:
            device_id = 0 if device_type == "cpu" else max(int(t.device.index or 0), 0)
            region_index[base] = len(regions)
            regions.append(Region(base, nbytes, device_id))
        region = region_index[base]
        kv_per_layer = 2 if "kv" in dim else 1
        for kv in range(kv_per_layer):
            offset = ptr - base + (kv * stride["kv"] if kv_per_layer == 2 else 0)
            planes.append(Plane(layer, kv, region, offset))
        geo = (
            dim["block"],
            heads,
            tokens,
            content,
            stride["block"],
            kv_per_layer,
            0 if order == "HND" else 1,
        )
        if geometry is None:
            geometry = geo
        elif geometry != geo:
            raise LayoutError(f"{what} differs in geometry from {names[0]}: {geo} vs {geometry}")
    assert geometry is not None
    nblocks, heads, tokens, content, block_stride, kv_per_layer, _order_i = geometry
    if heads != probe_heads:
        raise LayoutError(
            f"KV cache tensors hold {heads} heads per rank (backend {declared.backend}, axes {axes}) but the "
            f"model has {heads_model} KV heads over TP {tp_size} ({probe_heads} per rank)"
        )
    if block_size % tokens:
        raise LayoutError(f"vLLM block size {block_size} is not a multiple of the kernel block size {tokens}")
    layout = KVLayout(
        num_layers=len(names),
        block_size=tokens,
        num_blocks=nblocks,
        total_kv_heads=heads_model,
        head_dim=content,
        dtype_size=elem,
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_per_layer=kv_per_layer,
        token_order="HND" if order == "HND" else "NHD",
        block_stride=block_stride,
        regions=tuple(regions),
        planes=tuple(planes),
        model_tag=model_tag,
    )
    return ProbedLayout(layout, block_size // tokens, declared, device_type)


def _check_stride_order(
    declared: KVCacheDeclaration, shape: tuple[int, ...], strides: tuple[int, ...], what: str
) -> None:
    """The declared physical order must agree with the strides (dims of size 1 are free)."""
    if declared.stride_order is None:
        return
    seen = [i for i in declared.stride_order if shape[i] > 1]
    got = [strides[i] for i in seen]
    if any(a < b for a, b in itertools.pairwise(got)):
        raise LayoutError(
            f"{what}: strides disagree with the backend's declared stride order {declared.stride_order}"
        )
