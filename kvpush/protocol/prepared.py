"""Prepared-list plans: descriptor lists prepared once per (prefill rank, decode rank) pair, requests as
index arrays into them.

`pair_units` runs once per peer (at handshake). It picks the *unit*: the largest piece that is contiguous
on both sides for any block table (a block of the smaller block size; a block x head slice for HND; one
token's head slice for NHD under a TP split) and describes every unit of each side as a few strided rows
(address, len, device, stride, count) for NIXL's prep_xfer_dlist. Where a side's units tile its memory
(packed layer-major planes, or block-major blocks), a whole region is one dense row and the unit index is
simply its offset / unit length, so units adjacent in memory have adjacent indices.

`build_index_plan` runs per request and only computes index arrays: the pieces of the request (as in
`build_plan`), sorted by source offset so that descending or shuffled tables still line up, replicated over
the planes in memory order. NIXL 1.5.1's makeXferReq merges a run of consecutive indices on both sides
into one descriptor when the rows are dense (measured: 2,048 consecutive indices -> descCount 1; indices
that are not ascending, or that cross a row, are not merged), so the posted descriptors are the same
maximal runs `build_plan` emits, without building a descriptor list per request.

A request's last unit may extend past its last token (a partial block moves as whole units). Those bytes
stay inside the request's own last source and destination blocks, past the tokens the decode will read.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..errors import LayoutError
from .groups import BlockIds, Table, TableArg, as_block_ids, check_group_tables, is_flat
from .layout import KVLayout, Plane, blocks_for
from .plan import group_tokens, placed_pair
from .units import I32, I64, IndexPlan, PairUnits, SideUnits

__all__ = ["Half", "IndexPlan", "PairUnits", "SideUnits", "build_index_plan", "half_plan", "pair_units"]

_INT32_MAX = 2**31 - 1


def _mode(src: KVLayout, dst: KVLayout, heads: tuple[int, int]) -> tuple[str, int, int]:
    g0, g1 = heads
    full = (g1 - g0) == src.num_kv_heads == dst.num_kv_heads
    unit = src.unit_bytes
    if src.token_order == "NHD" and not full:
        return "token", 1, (g1 - g0) * unit
    chunk = min(src.block_size, dst.block_size)
    if src.token_order == "NHD":
        return "nhd", chunk, chunk * (g1 - g0) * unit
    return "hnd", chunk, chunk * unit


def _slots(layout: KVLayout, mode: str, chunk: int, heads: tuple[int, int]) -> tuple[int, I64]:
    """Units per block and each unit's byte offset inside the block (in slot order)."""
    lo = layout.kv_heads[0]
    nh, bs, u = layout.num_kv_heads, layout.block_size, layout.unit_bytes
    if mode == "token":
        t = np.arange(bs, dtype=np.int64)
        return bs, (t * nh + (heads[0] - lo)) * u
    per = bs // chunk
    if mode == "nhd":
        return per, np.arange(per, dtype=np.int64) * chunk * nh * u
    k = np.arange(nh * per, dtype=np.int64)  # slot = head * per + sub-chunk: memory order inside a block
    return nh * per, ((k // per) * bs + (k % per) * chunk) * u


_Row = tuple[int, int, int, int, int]  # (addr, len, device, stride, count), as NIXL's prep_xfer_dlist takes


def _side(layout: KVLayout, mode: str, chunk: int, unit: int, heads: tuple[int, int]) -> SideUnits:
    slots, slot_off = _slots(layout, mode, chunk, heads)
    planes = [
        layout.plane(layer, kv) for layer in range(layout.num_layers) for kv in range(layout.kv_per_layer)
    ]
    block_dense = slots * unit == layout.block_bytes and bool(np.all(slot_off == np.arange(slots) * unit))
    by_region: dict[int, list[int]] = {}
    for i, p in enumerate(planes):
        by_region.setdefault(p.region, []).append(i)
    dense, block_outer = _tiling(layout, planes, by_region) if block_dense else (False, False)
    plane_base = np.empty(len(planes), dtype=np.int64)
    if dense:
        rows = _dense_rows(layout, planes, by_region, slots, unit, plane_base)
        blk_mult, slot_mult = layout.block_stride // unit, 1
    elif block_dense:
        rows = _block_rows(layout, planes, slots, unit, plane_base)
        blk_mult, slot_mult = slots, 1
    else:
        rows = _slot_rows(layout, planes, slot_off, unit, plane_base)
        blk_mult, slot_mult = 1, layout.num_blocks
    total = len(planes) * layout.num_blocks * slots
    if total > _INT32_MAX:
        raise LayoutError(f"{total} units do not fit NIXL's int32 indices; use a larger block size")
    return SideUnits(
        np.asarray(rows, dtype=np.int64),
        plane_base,
        blk_mult,
        slot_mult,
        block_dense,
        block_outer,
        slots,
    )


def _tiling(layout: KVLayout, planes: list[Plane], by_region: dict[int, list[int]]) -> tuple[bool, bool]:
    """(dense, block_outer): whether the planes tile every region they are in, each region then one dense
    row of units (layer-major packed: plane after plane; or block-major: block after block, planes inside);
    block_outer is set by the first block-major region of several planes (regions after a region that
    does not tile are not looked at)."""
    bb, stride, nb = layout.block_bytes, layout.block_stride, layout.num_blocks
    block_outer = False
    for members in by_region.values():
        offs = sorted(planes[i].offset for i in members)
        gaps = {b - a for a, b in itertools.pairwise(offs)}
        if stride == bb and gaps <= {nb * bb}:
            continue  # layer-major packed
        if stride == len(members) * bb and gaps <= {bb}:
            block_outer = len(members) > 1  # block-major
            continue
        return False, block_outer
    return True, block_outer


def _dense_rows(
    layout: KVLayout, planes: list[Plane], by_region: dict[int, list[int]], slots: int, unit: int, base: I64
) -> list[_Row]:
    """Tiled regions: one row per region; a plane's units start at its offset in the region / unit."""
    rows: list[_Row] = []
    start = 0
    for r in sorted(by_region):
        members = by_region[r]
        o0 = min(planes[i].offset for i in members)
        region = layout.regions[r]
        count = len(members) * layout.num_blocks * slots
        rows.append((region.addr + o0, unit, region.device_id, unit, count))
        for i in members:
            base[i] = start + (planes[i].offset - o0) // unit
        start += count
    return rows


def _block_rows(layout: KVLayout, planes: list[Plane], slots: int, unit: int, base: I64) -> list[_Row]:
    """Padded blocks: one dense row per (plane, block), so a block's units still merge."""
    rows: list[_Row] = []
    stride, nb = layout.block_stride, layout.num_blocks
    for i, p in enumerate(planes):
        region = layout.regions[p.region]
        base[i] = i * nb * slots
        start = region.addr + p.offset
        rows.extend((start + b * stride, unit, region.device_id, unit, slots) for b in range(nb))
    return rows


def _slot_rows(layout: KVLayout, planes: list[Plane], slot_off: I64, unit: int, base: I64) -> list[_Row]:
    """One row per (plane, slot): units of a block are not adjacent, nothing can merge."""
    rows: list[_Row] = []
    stride, nb, slots = layout.block_stride, layout.num_blocks, len(slot_off)
    for i, p in enumerate(planes):
        region = layout.regions[p.region]
        base[i] = i * slots * nb
        for k in range(slots):
            rows.append((region.addr + p.offset + int(slot_off[k]), unit, region.device_id, stride, nb))
    return rows


def pair_units(src: KVLayout, dst: KVLayout, heads: tuple[int, int] | None = None) -> PairUnits:
    """Precompute the prepared-list geometry of a (prefill rank, decode rank) pair; both placed in memory."""
    heads = placed_pair(src, dst, heads, "prepare lists")
    mode, chunk, unit = _mode(src, dst, heads)
    kvs = range(src.kv_per_layer)
    layer = np.asarray([layer for layer in range(src.num_layers) for _ in kvs], dtype=np.int64)
    group = np.asarray([src.group_of(layer) for layer in range(src.num_layers) for _ in kvs], dtype=np.int64)
    d = _side(dst, mode, chunk, unit, heads)
    # dst plane (its (layer, kv) order) of each src plane: the same model layer, whatever its local index
    to_dst = np.asarray(
        [dst.local_layer(g) * dst.kv_per_layer + kv for g in src.global_layers for kv in kvs], dtype=np.int64
    )
    d = dataclasses.replace(d, plane_base=d.plane_base[to_dst])
    return PairUnits(
        src, dst, heads, mode, chunk, unit, _side(src, mode, chunk, unit, heads), d, layer, group
    )


def _piece_index(
    layout: KVLayout, side: SideUnits, mode: str, chunk: int, table: I64, tok: I64, head: I64
) -> I64:
    """Per-piece index inside a plane: blk * blk_mult + slot * slot_mult."""
    bs = layout.block_size
    blk = table[tok // bs]
    t_in = tok % bs
    if mode == "token":
        slot = t_in
    elif mode == "nhd":
        slot = t_in // chunk
    else:
        slot = (head - layout.kv_heads[0]) * (bs // chunk) + t_in // chunk
    return blk * side.blk_mult + slot * side.slot_mult


# Up to this many pieces (units per plane) a request is planned in plain Python over one plane row and
# replicated over the planes with one numpy call: a short prompt's plan is then a few microseconds, where
# the array path's two dozen small numpy calls cost ~40 us (the per-WRITE budget is 100 us).
SMALL_PLAN_PIECES = 64


def _pieces_py(
    layout: KVLayout, side: SideUnits, pair: PairUnits, table: tuple[int, ...], n: int
) -> list[int]:
    """_piece_index in plain Python, pieces in the array path's order (token chunk, then head)."""
    bs, chunk, bm, sm = layout.block_size, pair.chunk, side.blk_mult, side.slot_mult
    if pair.mode == "token":
        return [table[t // bs] * bm + (t % bs) * sm for t in range(n)]
    if pair.mode == "nhd":
        return [table[t // bs] * bm + (t % bs) // chunk * sm for t in range(0, n, chunk)]
    per, lo = bs // chunk, layout.kv_heads[0]
    g0, g1 = pair.heads
    return [
        table[t // bs] * bm + ((h - lo) * per + (t % bs) // chunk) * sm
        for t in range(0, n, chunk)
        for h in range(g0, g1)
    ]


@dataclass(frozen=True)
class _Planes:
    """The planes a plan covers, in ascending source order (as the array path orders them), as int32
    bases, and the gaps between neighbours' bases (where two planes' pieces may merge)."""

    s_base: I32
    d_base: I32
    gaps: dict[tuple[int, int], int]  # (source gap, destination gap) -> how many neighbours have it


_PLANES: dict[tuple[int, int, int], tuple[PairUnits, _Planes]] = {}


def _planes(pair: PairUnits, layers: range | None) -> _Planes:
    key = (id(pair), -1, -1) if layers is None else (id(pair), layers.start, layers.stop)
    got = _PLANES.get(key)
    if got is not None and got[0] is pair:
        return got[1]
    planes = np.arange(pair.plane_layer.shape[0])
    if layers is not None:
        planes = planes[(pair.plane_layer >= layers.start) & (pair.plane_layer < layers.stop)]
    s_base, d_base = pair.s.plane_base[planes], pair.d.plane_base[planes]
    order = np.argsort(s_base, kind="stable")
    s_base, d_base = s_base[order], d_base[order]
    gaps: dict[tuple[int, int], int] = {}
    for gap in zip(np.diff(s_base).tolist(), np.diff(d_base).tolist(), strict=True):
        gaps[gap] = gaps.get(gap, 0) + 1
    made = _Planes(s_base.astype(np.int32), d_base.astype(np.int32), gaps)
    if len(_PLANES) >= 256:  # pairs come and go with peers: keep the cache bounded
        _PLANES.clear()
    _PLANES[key] = (pair, made)
    return made


@dataclass(frozen=True)
class Half:
    """One side of a short one-piece request's plan, made when that side's table is known before the
    other's: the later event (the trigger) then plans only the other side. Used only where it matches."""

    pair: PairUnits
    block_ids: TableArg  # as given; a plan uses the half only for this very table
    num_tokens: int
    pieces: list[int]  # a source half's sorted ascending (the plan's order); a destination's as planned
    idx: I32  # every plane's pieces (planes in ascending source order), as the plan posts them
    # a source half: the order that sorted its pieces (None: they were ascending already); the other
    # side's pieces follow it at the trigger, so a shuffled source table keeps its half
    order: list[int] | None = None

    def fits(self, pair: PairUnits, block_ids: TableArg, num_tokens: int) -> bool:
        return self.pair is pair and self.num_tokens == num_tokens and self.block_ids == block_ids


def half_plan(pair: PairUnits, dst: bool, block_ids: TableArg, num_tokens: int) -> Half | None:
    """The source's (dst False) or destination's half of a whole request's plan (every layer); None for
    a request the array path plans, or a table that does not check (the full plan then says why)."""
    moved = _small_moved(pair, num_tokens)
    layout, side = (pair.dst, pair.d) if dst else (pair.src, pair.s)
    table = None if moved is None else plain_table(layout, block_ids, num_tokens)
    if moved is None or table is None:
        return None
    pieces, order = _pieces_py(layout, side, pair, table, moved), None
    if not dst:
        pieces, order = _in_source_order(pieces)
    pl = _planes(pair, None)
    idx = np.add.outer(pl.d_base if dst else pl.s_base, np.asarray(pieces, dtype=np.int32)).ravel()
    return Half(pair, block_ids, num_tokens, pieces, idx, order)


def _in_source_order(pieces: list[int]) -> tuple[list[int], list[int] | None]:
    """Source pieces sorted ascending (stable, as the array path's argsort) and the order that sorted
    them, None when they already were (the common case: a table of ascending blocks)."""
    if all(b > a for a, b in itertools.pairwise(pieces)):
        return pieces, None
    order = sorted(range(len(pieces)), key=pieces.__getitem__)
    return [pieces[i] for i in order], order


def _small_plan(
    pair: PairUnits,
    s_tab: tuple[int, ...],
    d_tab: tuple[int, ...],
    num_tokens: int,
    layers: range | None,
    halves: tuple[Half | None, Half | None] = (None, None),
) -> IndexPlan:
    """A short request: one plane row's pieces in Python, then every plane by one outer sum. The
    descriptor count follows from the row: the breaks inside it repeat in every plane, and two
    neighbouring planes join where the gap between their bases closes the row exactly. `halves`:
    (source, destination) sides made before (whole requests only), or None."""
    src, dst = pair.src, pair.dst
    s_half, d_half = halves
    if s_half:  # already in the plan's order, and with the order that sorted it
        s_p, order = s_half.pieces, s_half.order
    else:
        s_p, order = _in_source_order(_pieces_py(src, pair.s, pair, s_tab, num_tokens))
    d_p = d_half.pieces if d_half else _pieces_py(dst, pair.d, pair, d_tab, num_tokens)
    if order is not None:  # the destination's pieces follow the source's sorted order
        d_p = [d_p[i] for i in order]
        d_half = None  # its indices follow the unsorted pieces
    pl = _planes(pair, layers)
    n_planes = int(pl.s_base.shape[0])
    s_idx = s_half.idx if s_half else np.add.outer(pl.s_base, np.asarray(s_p, dtype=np.int32)).ravel()
    d_idx = d_half.idx if d_half else np.add.outer(pl.d_base, np.asarray(d_p, dtype=np.int32)).ravel()
    if pair.mergeable:
        pairs = zip(itertools.pairwise(s_p), itertools.pairwise(d_p), strict=True)
        breaks = sum(1 for (a, b), (c, d) in pairs if b != a + 1 or d != c + 1)
        joins = pl.gaps.get((s_p[-1] - s_p[0] + 1, d_p[-1] - d_p[0] + 1), 0)
        n_desc = n_planes * (breaks + 1) - joins
    else:
        n_desc = n_planes * len(s_p)
    g0, g1 = pair.heads
    exact = num_tokens * (g1 - g0) * src.unit_bytes * n_planes
    n_src = blocks_for(num_tokens, src.block_size)
    return IndexPlan(s_idx, d_idx, pair.unit_bytes, n_desc, num_tokens, n_src, exact)


def _group_pieces(
    pair: PairUnits, g: int, s_tab: I64, d_tab: I64, tokens: tuple[int, int]
) -> tuple[I64, I64]:
    """Per-plane unit indices (src, dst) of group g's tokens [t0, t1), t0 rounded down to a unit (a unit
    never crosses a block of either side, so the extra tokens stay inside a block the window needs)."""
    src, dst = pair.src, pair.dst
    g0, g1 = pair.heads
    t0, t1 = tokens
    t0 -= t0 % pair.chunk
    if pair.mode == "hnd":
        starts = np.arange(t0, t1, pair.chunk, dtype=np.int64)
        nh = g1 - g0
        tok = np.repeat(starts, nh)
        head = np.tile(np.arange(g0, g1, dtype=np.int64), starts.shape[0])
    else:
        tok = np.arange(t0, t1, pair.chunk, dtype=np.int64)
        head = tok  # unused outside "hnd"
    s_p = _piece_index(src, pair.s, pair.mode, pair.chunk, s_tab, tok, head)
    d_p = _piece_index(dst, pair.d, pair.mode, pair.chunk, d_tab, tok, head)
    if s_p.shape[0] > 1 and not bool(np.all(s_p[1:] > s_p[:-1])):
        order = np.argsort(s_p, kind="stable")  # ascending source: runs become consecutive indices
        s_p, d_p = s_p[order], d_p[order]
    return s_p, d_p


def plain_table(layout: KVLayout, block_ids: TableArg, num_tokens: int) -> Table | None:
    """check_group_tables' common case in a few C-level calls: one full-attention group, a flat table of
    ints inside the cache, the blocks num_tokens needs all different. The table as a tuple, else None
    (another shape, or a problem: check_group_tables then names it). Tables are checked on the engine's
    call and on every WRITE; the general walk costs tens of microseconds on a cold core."""
    if layout.num_groups != 1 or layout.window(0) or type(block_ids) not in (tuple, list) or not block_ids:
        return None
    if set(map(type, block_ids)) != {int}:
        return None
    ids = cast(Table, tuple(block_ids))  # every element is an int (checked just above)
    need = blocks_for(num_tokens, layout.block_size)
    if need > len(ids) or min(ids) < 0 or max(ids) >= layout.num_blocks or len(set(ids[:need])) != need:
        return None
    return ids


def _tables(layout: KVLayout, block_ids: TableArg, num_tokens: int, who: str) -> tuple[Table, ...]:
    """check_group_tables(as_block_ids(...)), through plain_table when it can answer."""
    table = plain_table(layout, block_ids, num_tokens)
    if table is None:
        return check_group_tables(layout, as_block_ids(block_ids), num_tokens, who)
    return (table[: blocks_for(num_tokens, layout.block_size)],)


def _small_moved(pair: PairUnits, num_tokens: int) -> int | None:
    """The tokens a short request moves (planned in plain Python over one plane row), else None."""
    src = pair.src
    if src.num_groups != 1 or src.window(0) or pair.s.block_outer:
        return None
    moved = src.tokens_to_move(num_tokens)
    g0, g1 = pair.heads
    pieces = -(-moved // pair.chunk) * (g1 - g0 if pair.mode == "hnd" else 1)
    return moved if pieces <= SMALL_PLAN_PIECES else None


def build_index_plan(
    pair: PairUnits,
    src_blocks: TableArg,
    dst_blocks: TableArg,
    num_tokens: int,
    layers: range | None = None,
    halves: tuple[Half | None, Half | None] = (None, None),
) -> IndexPlan:
    """The first `num_tokens` tokens of src's blocks onto dst's blocks, as prepared-list indices: per
    KV-cache group through its own tables, only the window's tokens (as `build_plan`).

    `layers` restricts the plan to a layer range (a later layer-streamed push posts one per group).
    `halves`: (source, destination) halves made earlier (`half_plan`); each is used (its table already
    checked) only if it was made for this pair, table and token count, and only for a whole request.
    """
    src, dst = pair.src, pair.dst
    if num_tokens <= 0:
        raise LayoutError(f"num_tokens must be > 0, got {num_tokens}")
    moved = _small_moved(pair, num_tokens)
    s_half, d_half = (None, None) if layers is not None or moved is None else halves
    s_half = s_half if s_half is not None and s_half.fits(pair, src_blocks, num_tokens) else None
    d_half = d_half if d_half is not None and d_half.fits(pair, dst_blocks, num_tokens) else None
    s_tabs = ((),) if s_half else _tables(src, src_blocks, num_tokens, "prefill")
    d_tabs = ((),) if d_half else _tables(dst, dst_blocks, num_tokens, "decode")
    if layers is not None and (layers.start < 0 or layers.stop > src.num_layers):
        raise LayoutError(f"layers {layers} outside 0..{src.num_layers - 1}")
    if moved is not None:  # a short request: plain Python over one plane row
        return _small_plan(pair, s_tabs[0], d_tabs[0], moved, layers, (s_half, d_half))
    return _array_plan(pair, s_tabs, d_tabs, num_tokens, layers)


def _array_plan(
    pair: PairUnits, s_tabs: BlockIds, d_tabs: BlockIds, num_tokens: int, layers: range | None
) -> IndexPlan:
    """Any request, in numpy, per KV-cache group (tables already checked; a flat table is group 0):
    pieces sorted by source offset, replicated over the planes in memory order."""
    src = pair.src
    s_tabs, d_tabs = (s_tabs,) if is_flat(s_tabs) else s_tabs, (d_tabs,) if is_flat(d_tabs) else d_tabs
    moved = src.tokens_to_move(num_tokens)
    n_src = blocks_for(moved, src.block_size)
    g0, g1 = pair.heads
    all_planes = np.arange(pair.plane_layer.shape[0])
    if layers is not None:
        all_planes = all_planes[(pair.plane_layer >= layers.start) & (pair.plane_layer < layers.stop)]
    s_parts: list[I64] = []
    d_parts: list[I64] = []
    exact = 0
    for g in range(src.num_groups):
        planes = all_planes[pair.plane_group[all_planes] == g] if src.num_groups > 1 else all_planes
        if planes.shape[0] == 0:
            continue
        tokens = group_tokens(src, g, num_tokens)
        exact += (tokens[1] - tokens[0]) * (g1 - g0) * src.unit_bytes * int(planes.shape[0])
        s_tab = np.asarray(s_tabs[g], dtype=np.int64)
        d_tab = np.asarray(d_tabs[g], dtype=np.int64)
        s_p, d_p = _group_pieces(pair, g, s_tab, d_tab, tokens)
        s_base, d_base = pair.s.plane_base[planes], pair.d.plane_base[planes]
        if pair.s.block_outer:  # block-major: piece outer, planes inner, so one block's planes are adjacent
            s_idx = (s_p[:, None] + s_base[None, :]).ravel()
            d_idx = (d_p[:, None] + d_base[None, :]).ravel()
            if pair.s.slots > 1:  # several units per plane in a block: memory order is block, plane, slot
                order = np.argsort(s_idx, kind="stable")
                s_idx, d_idx = s_idx[order], d_idx[order]
        else:
            order = np.argsort(s_base, kind="stable")
            s_base, d_base = s_base[order], d_base[order]
            s_idx = (s_base[:, None] + s_p[None, :]).ravel()
            d_idx = (d_base[:, None] + d_p[None, :]).ravel()
        s_parts.append(s_idx)
        d_parts.append(d_idx)
    if len(s_parts) == 1:
        s_idx, d_idx = s_parts[0], d_parts[0]
    else:  # several groups: their planes interleave in memory; ascending source order lets runs merge
        s_idx = np.concatenate(s_parts) if s_parts else np.zeros(0, dtype=np.int64)
        d_idx = np.concatenate(d_parts) if d_parts else np.zeros(0, dtype=np.int64)
        order = np.argsort(s_idx, kind="stable")
        s_idx, d_idx = s_idx[order], d_idx[order]
    if pair.mergeable and s_idx.shape[0] > 1:
        breaks = np.count_nonzero((s_idx[1:] != s_idx[:-1] + 1) | (d_idx[1:] != d_idx[:-1] + 1))
        n_desc = int(breaks) + 1
    else:
        n_desc = int(s_idx.shape[0])
    return IndexPlan(
        s_idx.astype(np.int32), d_idx.astype(np.int32), pair.unit_bytes, n_desc, moved, n_src, exact
    )
