"""Byte-level helpers for layouts with KV-cache groups, windows, layer subsets (PP stages), MLA and 1-byte
dtypes: a per-(model layer, kv, head, token) pattern, the cache a transfer must leave on the decode, and a
memcpy that runs a plan (or an index plan) between two numpy buffers standing for the registered memory."""

from __future__ import annotations

import numpy as np

from kvpush.protocol.groups import HOLE, window_token_range
from kvpush.protocol.layout import KVLayout, packed_planes
from kvpush.protocol.plan import TransferPlan
from kvpush.protocol.prepared import IndexPlan, PairUnits

U8 = np.ndarray


def placed(layout: KVLayout, base: int | None = None) -> tuple[KVLayout, U8]:
    """The layout packed into a zeroed buffer; `base` fakes the address (else the buffer's own)."""
    buf = np.zeros(layout.cache_bytes, dtype=np.uint8)
    addr = buf.ctypes.data if base is None else base
    return packed_planes(layout, addr), buf


def row(layer: int, kv: int, head: int, token: int, tag: int, nbytes: int) -> U8:
    """The bytes of one (token, head) unit: never zero, different per model layer, kv, head, token, tag."""
    seed = (layer * 7919 + kv * 104729 + head * 1299709 + token * 15485863 + tag * 32452843) % 2**31
    vals = (np.arange(nbytes, dtype=np.int64) * 131 + seed) % 251 + 1
    return vals.astype(np.uint8)


def _unit_offset(layout: KVLayout, layer: int, kv: int, block: int, t_in: int, local_head: int) -> int:
    p = layout.plane(layer, kv)
    return p.offset + block * layout.block_stride + layout.unit_offset(t_in, local_head)


def fill(buf: U8, layout: KVLayout, tables: tuple[tuple[int, ...], ...], n: int, tag: int) -> None:
    """Write every token 0..n-1 of every local layer whose block in its group's table is not a hole."""
    lo, hi = layout.kv_heads
    for layer, glayer in enumerate(layout.global_layers):
        table = tables[layout.group_of(layer)]
        for kv in range(layout.kv_per_layer):
            for t in range(n):
                block = table[t // layout.block_size]
                if block == HOLE:
                    continue
                for h in range(lo, hi):
                    off = _unit_offset(layout, layer, kv, block, t % layout.block_size, h - lo)
                    buf[off : off + layout.unit_bytes] = row(glayer, kv, h, t, tag, layout.unit_bytes)


def expected(
    dst: KVLayout,
    tables: tuple[tuple[int, ...], ...],
    n: int,
    tag: int,
    heads: tuple[int, int],
    layers: set[int],
    align: int = 1,
) -> U8:
    """The decode buffer a transfer must leave: zero everywhere but the units of the model layers in
    `layers`, heads `heads`, each group's window tokens (first rounded down to `align`)."""
    out = np.zeros(dst.cache_bytes, dtype=np.uint8)
    lo = dst.kv_heads[0]
    for layer, glayer in enumerate(dst.global_layers):
        if glayer not in layers:
            continue
        g = dst.group_of(layer)
        first, _ = window_token_range(n, dst.window(g), align)
        for kv in range(dst.kv_per_layer):
            for t in range(first, n):
                block = tables[g][t // dst.block_size]
                for h in range(*heads):
                    off = _unit_offset(dst, layer, kv, block, t % dst.block_size, h - lo)
                    out[off : off + dst.unit_bytes] = row(glayer, kv, h, t, tag, dst.unit_bytes)
    return out


def run_plan(plan: TransferPlan, src: KVLayout, sbuf: U8, dst: KVLayout, dbuf: U8) -> None:
    s0, d0 = src.regions[0].addr, dst.regions[0].addr
    for s, d, ln in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.length.tolist(), strict=True):
        dbuf[d - d0 : d - d0 + ln] = sbuf[s - s0 : s - s0 + ln]


def _unit_addrs(rows: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [addr + stride * np.arange(count) for addr, _ln, _dev, stride, count in rows.tolist()]
    )


def run_index_plan(plan: IndexPlan, pair: PairUnits, sbuf: U8, dbuf: U8) -> None:
    s_units, d_units = _unit_addrs(pair.s.rows), _unit_addrs(pair.d.rows)
    s0, d0, ln = pair.src.regions[0].addr, pair.dst.regions[0].addr, plan.unit_bytes
    for si, di in zip(plan.src_idx.tolist(), plan.dst_idx.tolist(), strict=True):
        s, d = int(s_units[si]) - s0, int(d_units[di]) - d0
        dbuf[d : d + ln] = sbuf[s : s + ln]
