"""TransferPlan: which source bytes go to which destination bytes, as few descriptors as possible.

The plan is computed with numpy on plane-relative offsets once (every plane of a layout has the same
shape), replicated over the planes, then merged: the descriptors are exactly the maximal runs that are
contiguous on both sides within one layer and one pair of memory regions. Keeping descriptors per layer
lets a caller post layer by layer while prefill still computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import LayoutError
from .groups import TableArg, as_block_ids, check_group_tables, window_token_range
from .layout import KVLayout, blocks_for, check_compatible, inner_offset

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class TransferPlan:
    src_addr: I64
    dst_addr: I64
    length: I64
    layer: I64
    src_dev: I64
    dst_dev: I64
    num_tokens: int
    num_blocks: int  # source blocks covered (for "descriptors vs blocks" reporting)

    @property
    def num_descriptors(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def layer_slices(self) -> dict[int, slice]:
        """layer -> slice of the descriptor arrays (descriptors are grouped by layer)."""
        out: dict[int, slice] = {}
        if self.num_descriptors == 0:
            return out
        change = np.flatnonzero(np.diff(self.layer)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [self.num_descriptors]))
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            out[int(self.layer[s])] = slice(s, e)
        return out

    def nixl_descs(self, part: slice = slice(None)) -> tuple[I64, I64]:
        """(src Nx3, dst Nx3) arrays of (addr, len, device) as NIXL's prep/xfer lists take them."""
        src = np.stack((self.src_addr[part], self.length[part], self.src_dev[part]), axis=1)
        dst = np.stack((self.dst_addr[part], self.length[part], self.dst_dev[part]), axis=1)
        return np.ascontiguousarray(src), np.ascontiguousarray(dst)


def _token_runs(t0: int, t1: int, chunk: int) -> tuple[I64, I64]:
    """Starts and lengths of the token runs [t0, t1) split at every multiple of `chunk` (a run never
    crosses a block of either side: chunk divides both block sizes)."""
    aligned = np.arange(t0 - t0 % chunk, t1, chunk, dtype=np.int64)
    starts = np.maximum(aligned, t0)
    return starts, np.minimum(aligned + chunk, t1) - starts


def _plane_pattern(
    src: KVLayout, dst: KVLayout, s_tab: I64, d_tab: I64, tokens: tuple[int, int], heads: tuple[int, int]
) -> tuple[I64, I64, I64]:
    """Plane-relative (src offset, dst offset, length) pieces of tokens [t0, t1), before merging."""
    t0, t1 = tokens
    g0, g1 = heads
    s_lo, d_lo = src.kv_heads[0], dst.kv_heads[0]
    unit = src.unit_bytes
    full = (g1 - g0) == src.num_kv_heads == dst.num_kv_heads
    if src.token_order == "NHD" and not full:
        tok = np.arange(t0, t1, dtype=np.int64)  # one piece per token: the head slice of that token
        head = np.full_like(tok, g0)
        length = np.full_like(tok, (g1 - g0) * unit)
    else:
        starts, counts = _token_runs(t0, t1, min(src.block_size, dst.block_size))
        if src.token_order == "NHD":  # full heads: a token run is contiguous on both sides
            tok, head = starts, np.full_like(starts, g0)
            length = counts * (g1 - g0) * unit
        else:  # HND: per head, a token run inside a block is contiguous
            nh = g1 - g0
            tok = np.repeat(starts, nh)
            head = np.tile(np.arange(g0, g1, dtype=np.int64), starts.shape[0])
            length = np.repeat(counts, nh) * unit

    def offsets(layout: KVLayout, table: I64, lo: int) -> I64:
        blk = table[tok // layout.block_size]
        t_in = tok % layout.block_size
        inner = inner_offset(
            layout.token_order, t_in, head - lo, layout.block_size, layout.num_kv_heads, unit
        )
        return blk * layout.block_stride + inner

    return offsets(src, s_tab, s_lo), offsets(dst, d_tab, d_lo), length


def group_tokens(layout: KVLayout, group: int, num_tokens: int) -> tuple[int, int]:
    """Tokens [first, end) of a group a transfer of num_tokens moves: the window's (exact, or whole
    blocks when the block interior is opaque), to the end of the last block when it is opaque."""
    align = layout.block_size if layout.atomic_blocks else 1
    first, _ = window_token_range(num_tokens, layout.window(group), align)
    return first, layout.tokens_to_move(num_tokens)


def _runs(src: I64, dst: I64, length: I64, group: I64) -> tuple[I64, I64]:
    """For pieces sorted by (group, src): index of each maximal run's first piece, and the run's length."""
    if src.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    cont = np.zeros(src.shape[0], dtype=bool)
    cont[1:] = (
        (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1]) & (group[1:] == group[:-1])
    )
    starts = np.flatnonzero(~cont)
    return starts, np.add.reduceat(length, starts)


def placed_pair(src: KVLayout, dst: KVLayout, heads: tuple[int, int] | None, purpose: str) -> tuple[int, int]:
    """The heads to move between two compatible layouts placed in memory (default: every head both hold),
    or LayoutError naming what stops `purpose`."""
    check_compatible(src, dst)
    if not src.planes or not dst.planes:
        raise LayoutError(f"both layouts must be placed in memory (regions and planes) to {purpose}")
    if heads is None:
        heads = (max(src.kv_heads[0], dst.kv_heads[0]), min(src.kv_heads[1], dst.kv_heads[1]))
    g0, g1 = heads
    if not (src.kv_heads[0] <= g0 < g1 <= src.kv_heads[1] and dst.kv_heads[0] <= g0 < g1 <= dst.kv_heads[1]):
        raise LayoutError(
            f"heads {heads} are not held by both prefill rank {src.kv_heads} and decode rank {dst.kv_heads}"
        )
    return heads


def build_plan(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: TableArg,
    dst_blocks: TableArg,
    num_tokens: int,
    layers: range | None = None,
    heads: tuple[int, int] | None = None,
    merge_layers: bool | None = None,
) -> TransferPlan:
    """Map the first `num_tokens` tokens of src's blocks onto dst's blocks: per KV-cache group, through
    that group's tables, only its window's tokens (`groups.window_token_range`); each of src's layers
    onto dst's layer of the same model index (src may be one pipeline stage of dst's layers).

    `heads` is the global KV-head range to move (default: every head both ranks hold; see kvpush.protocol.tp).
    Both layouts must carry memory (regions and planes). Runs merge across layers when `merge_layers`
    (default: when both sides are block-major, where one block's layers are one run); a caller that
    streams layer by layer plans `layers=range(l, l + 1)` instead.
    """
    if merge_layers is None:
        merge_layers = src.kind == dst.kind == "block-major"
    if num_tokens <= 0:
        raise LayoutError(f"num_tokens must be > 0, got {num_tokens}")
    heads = placed_pair(src, dst, heads, "plan a transfer")
    layers = range(src.num_layers) if layers is None else layers
    if layers and (layers.start < 0 or layers.stop > src.num_layers):
        raise LayoutError(f"layers {layers} outside 0..{src.num_layers - 1}")
    s_tabs = check_group_tables(src, as_block_ids(src_blocks), num_tokens, "prefill")
    d_tabs = check_group_tables(dst, as_block_ids(dst_blocks), num_tokens, "decode")
    moved = src.tokens_to_move(num_tokens)  # whole blocks when the block interior is opaque
    n_src = blocks_for(moved, src.block_size)

    n_src_regions, n_dst_regions = len(src.regions), len(dst.regions)
    parts: list[tuple[I64, I64, I64, I64, I64]] = []  # per group: src, dst, length, merge group, layer
    for g in range(src.num_groups):
        planes = [
            (layer, kv) for layer in layers if src.group_of(layer) == g for kv in range(src.kv_per_layer)
        ]
        if not planes:
            continue
        s_tab = np.asarray(s_tabs[g], dtype=np.int64)
        d_tab = np.asarray(d_tabs[g], dtype=np.int64)
        tokens = group_tokens(src, g, num_tokens)
        s_off, d_off, length = _plane_pattern(src, dst, s_tab, d_tab, tokens, heads)
        order = np.argsort(s_off, kind="stable")
        s_off, d_off, length = s_off[order], d_off[order], length[order]
        starts, length = _runs(s_off, d_off, length, np.zeros_like(s_off))
        s_off, d_off = s_off[starts], d_off[starts]
        s_base, d_base, s_dev, d_dev, group = (np.empty(len(planes), dtype=np.int64) for _ in range(5))
        for i, (layer, kv) in enumerate(planes):
            sp, dp = src.plane(layer, kv), dst.plane(dst.local_layer(src.global_layers[layer]), kv)
            s_base[i] = src.regions[sp.region].addr + sp.offset
            d_base[i] = dst.regions[dp.region].addr + dp.offset
            s_dev[i] = src.regions[sp.region].device_id
            d_dev[i] = dst.regions[dp.region].device_id
            # runs may merge across the planes of one layer (of every layer when merge_layers), never
            # across memory regions or devices
            group[i] = (
                (0 if merge_layers else layer) * n_src_regions + sp.region
            ) * n_dst_regions + dp.region
        m = s_off.shape[0]
        layer_of = np.asarray([layer for layer, _kv in planes], dtype=np.int64)
        parts.append(
            (
                (s_base[:, None] + s_off[None, :]).ravel(),
                (d_base[:, None] + d_off[None, :]).ravel(),
                np.tile(length, len(planes)),
                np.repeat(group, m),
                np.stack((np.repeat(layer_of, m), np.repeat(s_dev, m), np.repeat(d_dev, m))),
            )
        )
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return TransferPlan(empty, empty, empty, empty, empty, empty, moved, n_src)
    a_src, a_dst, a_len, a_grp = (np.concatenate([p[i] for p in parts]) for i in range(4))
    meta = np.concatenate([p[4] for p in parts], axis=1)
    order = np.lexsort((a_src, a_grp))
    a_src, a_dst, a_len, a_grp = a_src[order], a_dst[order], a_len[order], a_grp[order]
    starts, run_len = _runs(a_src, a_dst, a_len, a_grp)
    first = order[starts]
    return TransferPlan(
        a_src[starts], a_dst[starts], run_len, meta[0, first], meta[1, first], meta[2, first], moved, n_src
    )
