"""A per-token byte pattern for KV caches, so the receiving side can check every byte it got.

Each (token, head) unit of each plane gets: the token index (4 bytes), a tag naming request, layer, K/V
and head (4 bytes), then bytes that depend on all of those. A unit that lands in the wrong token, head,
layer or request, or not at all, fails the comparison.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpush.protocol.layout import KVLayout

U8 = npt.NDArray[np.uint8]


def _plane_view(buffer: U8, layout: KVLayout, layer: int, kv: int) -> U8:
    """The plane as (blocks, block_size, heads, unit) for NHD or (blocks, heads, block_size, unit) for HND."""
    p = layout.plane(layer, kv)
    span = (layout.num_blocks - 1) * layout.block_stride + layout.block_bytes
    if p.offset + span > buffer.shape[0]:
        raise ValueError(f"plane ({layer}, {kv}) overruns the buffer")
    # strided over the blocks, so block-major planes (interleaved inside each block) work as well
    blocks = np.lib.stride_tricks.as_strided(
        buffer[p.offset :], shape=(layout.num_blocks, layout.block_bytes), strides=(layout.block_stride, 1)
    )
    h, bs, u = layout.num_kv_heads, layout.block_size, layout.unit_bytes
    shape = (layout.num_blocks, bs, h, u) if layout.token_order == "NHD" else (layout.num_blocks, h, bs, u)
    return blocks.reshape(shape)


def expected_rows(request_tag: int, layer: int, kv: int, head: int, n: int, unit: int) -> U8:
    if unit < 8:
        raise ValueError("the pattern needs units (head_dim x dtype) of at least 8 bytes")
    t = np.arange(n, dtype=np.int64)
    salt = (request_tag * 1_000_003 + layer * 131 + kv * 71 + head * 29) & 0xFF
    rows = ((t[:, None] * 7 + np.arange(unit)[None, :] + salt) & 0xFF).astype(np.uint8)
    rows[:, 0:4] = t.astype("<u4").view(np.uint8).reshape(n, 4)
    tag = np.array([(request_tag & 0xFFFF) | (layer << 16) | (kv << 23) | (head << 24)], dtype="<u4")
    rows[:, 4:8] = tag.view(np.uint8)
    return rows


def _token_index(
    layout: KVLayout, blocks: list[int], n: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    t = np.arange(n, dtype=np.int64)
    table = np.asarray(blocks, dtype=np.int64)
    return table[t // layout.block_size], t % layout.block_size


def fill(
    buffer: U8, layout: KVLayout, blocks: list[int], n: int, request_tag: int, layers: range | None = None
) -> None:
    """Write the pattern for the first n tokens of a request into its blocks (this rank's heads); only
    `layers` when given (a layer-by-layer prefill writes one layer at a time)."""
    blk, pos = _token_index(layout, blocks, n)
    lo, hi = layout.kv_heads
    for layer in range(layout.num_layers) if layers is None else layers:
        for kv in range(layout.kv_per_layer):
            view = _plane_view(buffer, layout, layer, kv)
            for g in range(lo, hi):
                rows = expected_rows(request_tag, layer, kv, g, n, layout.unit_bytes)
                if layout.token_order == "NHD":
                    view[blk, pos, g - lo] = rows
                else:
                    view[blk, g - lo, pos] = rows


def copy_layer(dst: U8, src: U8, layout: KVLayout, blocks: list[int], layer: int) -> None:
    """Copy one layer's planes of these blocks from src to dst (same layout): a layer "computed"."""
    idx = np.asarray(blocks, dtype=np.int64)
    for kv in range(layout.kv_per_layer):
        _plane_view(dst, layout, layer, kv)[idx] = _plane_view(src, layout, layer, kv)[idx]


def count_wrong_bytes(buffer: U8, layout: KVLayout, blocks: list[int], n: int, request_tag: int) -> int:
    """How many bytes of the request's units differ from the pattern (0 = every byte verified)."""
    blk, pos = _token_index(layout, blocks, n)
    lo, hi = layout.kv_heads
    wrong = 0
    for layer in range(layout.num_layers):
        for kv in range(layout.kv_per_layer):
            view = _plane_view(buffer, layout, layer, kv)
            for g in range(lo, hi):
                rows = expected_rows(request_tag, layer, kv, g, n, layout.unit_bytes)
                got = view[blk, pos, g - lo] if layout.token_order == "NHD" else view[blk, g - lo, pos]
                wrong += int(np.count_nonzero(got != rows))
    return wrong


def scrub(buffer: U8, layout: KVLayout, blocks: list[int]) -> None:
    """Zero a request's blocks before reuse, so stale bytes can never pass for fresh ones."""
    for layer in range(layout.num_layers):
        for kv in range(layout.kv_per_layer):
            _plane_view(buffer, layout, layer, kv)[np.asarray(blocks, dtype=np.int64)] = 0


def count_dirty_bytes(buffer: U8, layout: KVLayout, blocks: list[int]) -> int:
    """How many bytes of these blocks are not zero: after `scrub`, any is a write that landed later."""
    if not blocks:
        return 0
    idx = np.asarray(blocks, dtype=np.int64)
    return sum(
        int(np.count_nonzero(_plane_view(buffer, layout, layer, kv)[idx]))
        for layer in range(layout.num_layers)
        for kv in range(layout.kv_per_layer)
    )
