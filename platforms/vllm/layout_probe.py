"""Describe vLLM's registered KV cache tensors as a kvpush KVLayout.

vLLM hands the connector one tensor per attention layer. Two shapes occur:

* vLLM >= 0.32 (RFC #42082): a 4D logical view [B, H, N, C] per layer, where C holds K then V of one
  (head, token) (head_size + head_size_v elements), with physical strides set by the KV cache layout
  (the CPU backend uses LBHNC: head-major inside a block). K and V are interleaved per token, so kvpush
  sees one plane per layer (kv_per_layer=1) whose "head dim" is K+V: the unit that is always contiguous.
* the older FlashAttention form [2, B, N, H, D] (K and V planes), with any stride permutation of N and H.

Blocks must be dense inside: a block's H x N units must be contiguous in one of the two orders; anything
else raises LayoutError naming the tensor, its shape and strides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpush.protocol.layout import KVLayout, LayoutError, Plane, Region


def _storage_span(t: Any) -> tuple[int, int]:
    st = t.untyped_storage()
    return int(st.data_ptr()), int(st.nbytes())


def _order(
    h_stride: int,
    n_stride: int,
    heads: int,
    tokens: int,
    unit: int,
    name: str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
) -> str:
    if (tokens == 1 or n_stride == unit) and (heads == 1 or h_stride == tokens * unit):
        return "HND"
    if (heads == 1 or h_stride == unit) and (tokens == 1 or n_stride == heads * unit):
        return "NHD"
    raise LayoutError(
        f"KV cache tensor {name} (shape {shape}, byte strides {strides}) is not dense inside a "
        "block; kvpush needs each block's heads x tokens units contiguous"
    )


def layout_from_kv_caches(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    total_kv_heads: int,
    tp_rank: int,
    tp_size: int,
    model_tag: str,
    split_content: bool = False,
) -> tuple[KVLayout, int]:
    """(layout, kernel blocks per vLLM block). Layers are taken in the order vLLM registered them.

    split_content: the backend reads a head's [N, C] block slice as [2N, C/2] (K rows, then V rows), as
    vLLM's CPU backend does; kvpush then sees 2H "virtual heads" of C/2 elements (K of head h is virtual
    head 2h, V is 2h+1), head-major. Otherwise C is one (token, head) unit holding K then V, as
    FlashAttention reads it.
    """
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    names = list(kv_caches)
    first = kv_caches[names[0]]
    elem = int(first.element_size())
    regions: list[Region] = []
    region_index: dict[int, int] = {}
    planes: list[Plane] = []
    geometry: tuple[int, ...] | None = None
    for layer, name in enumerate(names):
        t = kv_caches[name]
        shape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) * elem for s in t.stride())
        base, nbytes = _storage_span(t)
        if base not in region_index:
            region_index[base] = len(regions)
            regions.append(Region(base, nbytes, 0 if t.device.type == "cpu" else int(t.device.index or 0)))
        region = region_index[base]
        if t.dim() == 4:  # [B, H, N, C]
            nblocks, heads, tokens, content = shape
            unit = content * elem
            if strides[3] != elem:
                raise LayoutError(
                    f"KV cache tensor {name}: the last dim is not contiguous (strides {strides})"
                )
            order = _order(strides[1], strides[2], heads, tokens, unit, name, shape, strides)
            if split_content:
                if order != "HND" or (tokens > 1 and strides[2] != unit) or content % 2:
                    raise LayoutError(
                        f"KV cache tensor {name} (shape {shape}, byte strides {strides}) is not "
                        "the head-major dense block the CPU backend reads as [2N, C/2]"
                    )
                heads, content = 2 * heads, content // 2
            geo = (nblocks, heads, tokens, content, strides[0], 1)
            planes.append(Plane(layer, 0, region, int(t.data_ptr()) - base))
        elif t.dim() == 5 and shape[0] == 2:  # [2, B, N, H, D]
            _two, nblocks, tokens, heads, content = shape
            unit = content * elem
            if strides[4] != elem:
                raise LayoutError(
                    f"KV cache tensor {name}: the last dim is not contiguous (strides {strides})"
                )
            order = _order(strides[3], strides[2], heads, tokens, unit, name, shape, strides)
            geo = (nblocks, heads, tokens, content, strides[1], 2)
            for kv in range(2):
                planes.append(Plane(layer, kv, region, int(t[kv].data_ptr()) - base))
        else:
            raise LayoutError(
                f"KV cache tensor {name} has shape {shape}; kvpush understands [B, H, N, C] "
                "views and [2, B, N, H, D] tensors"
            )
        if geometry is None:
            geometry = (*geo, {"HND": 0, "NHD": 1}[order])
        elif geometry != (*geo, {"HND": 0, "NHD": 1}[order]):
            raise LayoutError(
                f"KV cache tensor {name} differs in geometry from {names[0]}: {geo} vs {geometry}"
            )
    assert geometry is not None
    nblocks, heads, tokens, content, block_stride, kv_per_layer, order_i = geometry
    if split_content:
        if tp_size > total_kv_heads:
            raise LayoutError(
                "kvpush: TP larger than the KV head count is not supported with the CPU backend"
            )
        total_kv_heads *= 2
    if block_size % tokens:
        raise LayoutError(f"vLLM block size {block_size} is not a multiple of the kernel block size {tokens}")
    ratio = block_size // tokens
    layout = KVLayout(
        num_layers=len(names),
        block_size=tokens,
        num_blocks=nblocks,
        total_kv_heads=total_kv_heads,
        head_dim=content,
        dtype_size=elem,
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_per_layer=kv_per_layer,
        token_order="HND" if order_i == 0 else "NHD",
        block_stride=block_stride,
        regions=tuple(regions),
        planes=tuple(planes),
        model_tag=model_tag,
    )
    if layout.num_kv_heads != heads:
        raise LayoutError(
            f"KV cache tensors hold {heads} heads per rank but the model has {total_kv_heads} "
            f"KV heads over TP {tp_size} ({layout.num_kv_heads} per rank)"
        )
    return layout, ratio


def expand_blocks(block_ids: list[int] | tuple[int, ...], ratio: int) -> list[int]:
    """vLLM block ids -> kernel block ids when one vLLM block spans `ratio` kernel blocks."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + i for b in block_ids for i in range(ratio)]
