"""Prepared-list plans: the index plan moves exactly the units build_plan moves (plus, at most, the rest of
a request's last unit inside its own blocks), and posts no more descriptors than build_plan's runs."""

from __future__ import annotations

import itertools
import mmap

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol import prepared
from kvpush.protocol.layout import KVLayout, packed_planes
from kvpush.protocol.plan import build_plan
from kvpush.protocol.prepared import build_index_plan, pair_units
from kvpush.protocol.tp import senders_for
from kvpush.transport.memory import expand_rows
from tests.protocol.test_plan import apply_plan, expected_units, make, scenarios


class BlockMajorCache:
    """A host buffer with the block-outermost placement (test twin of the demo's cache)."""

    def __init__(self, layout: KVLayout) -> None:
        self._mm = mmap.mmap(-1, layout.cache_bytes)
        self.buffer = np.frombuffer(self._mm, dtype=np.uint8)
        self.layout = packed_planes(layout, int(self.buffer.ctypes.data))
        assert self.layout.kind == "block-major"

    @property
    def nbytes(self) -> int:
        return int(self.buffer.shape[0])


def apply_index_plan(pair, plan, src, dst) -> np.ndarray:
    written = np.zeros(dst.nbytes, dtype=np.int32)
    sd, dd = expand_rows(pair.s.rows), expand_rows(pair.d.rows)
    s0, d0 = src.layout.regions[0].addr, dst.layout.regions[0].addr
    for si, di in zip(plan.src_idx.tolist(), plan.dst_idx.tolist(), strict=True):
        sa, ln, _ = sd[si]
        da, ln2, _ = dd[di]
        assert ln == ln2 == plan.unit_bytes
        so, do = int(sa - s0), int(da - d0)
        dst.buffer[do : do + ln] = src.buffer[so : so + ln]
        written[do : do + ln] += 1
    return written


def request_block_mask(cache, table) -> np.ndarray:
    lay = cache.layout
    mask = np.zeros(cache.nbytes, dtype=bool)
    base = lay.regions[0].addr
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_per_layer):
            for b in table:
                a = lay.address(layer, kv, b, 0, 0) - base
                mask[a : a + lay.block_bytes] = True
    return mask


def check(src, dst, p_tab, d_tab, n, heads):
    rng = np.random.default_rng(2)
    src.buffer[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    dst.buffer[:] = 0
    pair = pair_units(src.layout, dst.layout, heads)
    plan = build_index_plan(pair, p_tab, d_tab, n)
    written = apply_index_plan(pair, plan, src, dst)
    unit = src.layout.unit_bytes
    d0, s0 = dst.layout.regions[0].addr, src.layout.regions[0].addr
    expect = np.zeros(dst.nbytes, dtype=bool)
    for _layer, sa, da in expected_units(src, dst, p_tab, d_tab, n, heads):
        np.testing.assert_array_equal(
            dst.buffer[da - d0 : da - d0 + unit], src.buffer[sa - s0 : sa - s0 + unit]
        )
        expect[da - d0 : da - d0 + unit] = True
    assert (written[expect] == 1).all(), "a unit of the request was written twice or not at all"
    assert (written <= 1).all()
    outside = (written > 0) & ~request_block_mask(dst, d_tab[: -(-n // dst.layout.block_size)])
    assert not outside.any(), "an index plan wrote outside the request's destination blocks"
    ref = build_plan(src.layout, dst.layout, p_tab, d_tab, n, heads=heads)
    assert plan.num_descriptors <= ref.num_descriptors
    assert plan.nbytes == ref.nbytes and plan.wire_bytes >= ref.nbytes
    return plan, ref


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_index_plan_moves_what_build_plan_moves(sc):
    src = make(
        sc["layers"], sc["p_bs"], sc["p_total"], sc["heads"], sc["p_rank"], sc["p_tp"], sc["order"], sc["pad"]
    )
    dst = make(sc["layers"], sc["d_bs"], sc["d_total"], sc["heads"], sc["d_rank"], sc["d_tp"], sc["order"])
    heads = senders_for(sc["d_rank"], sc["d_tp"], sc["p_tp"], sc["heads"])[sc["p_rank"]]
    check(src, dst, sc["p_tab"], sc["d_tab"], sc["n"], heads)


def _bm(bs, blocks, order="NHD", heads=2, rank=0, tp=1, layers=3) -> BlockMajorCache:
    return BlockMajorCache(
        KVLayout(
            num_layers=layers,
            block_size=bs,
            num_blocks=blocks,
            total_kv_heads=heads,
            head_dim=4,
            dtype_size=2,
            tp_rank=rank,
            tp_size=tp,
            token_order=order,  # type: ignore[arg-type]
            block_major=True,
        )
    )


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_block_major_index_plan(sc):
    src = _bm(sc["p_bs"], sc["p_total"], sc["order"], sc["heads"], sc["p_rank"], sc["p_tp"], sc["layers"])
    dst = _bm(sc["d_bs"], sc["d_total"], sc["order"], sc["heads"], sc["d_rank"], sc["d_tp"], sc["layers"])
    heads = senders_for(sc["d_rank"], sc["d_tp"], sc["p_tp"], sc["heads"])[sc["p_rank"]]
    check(src, dst, sc["p_tab"], sc["d_tab"], sc["n"], heads)
    # build_plan on block-major pairs is checked byte for byte too, merging across layers
    plan = build_plan(src.layout, dst.layout, sc["p_tab"], sc["d_tab"], sc["n"], heads=heads)
    written = apply_plan(plan, src, dst)
    assert written.max() <= 1


def test_block_major_merges_every_layer_of_a_run():
    src, dst = _bm(16, 64, layers=8), _bm(16, 64, layers=8)
    tab_s, tab_d = list(range(10, 26)), list(range(4, 20))  # one contiguous run on both sides
    plan, ref = check(src, dst, tab_s, tab_d, 256, (0, 2))
    assert ref.num_descriptors == 1 and plan.num_descriptors == 1
    # layer-major: one run per plane (K and V of a layer are not adjacent for a run inside the plane)
    lm = build_plan(
        make(8, 16, 64, 2, 0, 1, "NHD").layout, make(8, 16, 64, 2, 0, 1, "NHD").layout, tab_s, tab_d, 256
    )
    assert lm.num_descriptors == 16
    # different block sizes: a block's planes are laid out differently on the two sides, so nothing
    # merges across planes or blocks (block-major pays off only with equal block sizes)
    plan2, ref2 = check(src, _bm(32, 32, layers=8), tab_s, list(range(4, 12)), 256, (0, 2))
    assert ref2.num_descriptors == plan2.num_descriptors > 200  # vs 1 with equal block sizes
    # per-layer slices stay addressable: one layer's plan of a block-major pair
    one = build_plan(src.layout, dst.layout, tab_s, tab_d, 256, layers=range(3, 4))
    assert set(one.layer.tolist()) == {3} and one.nbytes == 256 * 2 * 2 * 2 * 4


def test_descending_tables_still_merge():
    src, dst = make(2, 16, 64, 1, 0, 1, "NHD"), make(2, 16, 64, 1, 0, 1, "NHD")
    tab = list(range(40, 8, -1))  # descending: ascending source order is ascending destination order
    plan, ref = check(src, dst, tab, tab, 32 * 16, (0, 1))
    assert plan.num_descriptors == ref.num_descriptors == 4  # one run per plane, not 32 blocks each


def test_pair_units_are_strided_rows():
    src, dst = make(4, 16, 1000, 1, 0, 1, "NHD"), make(4, 32, 500, 1, 0, 1, "NHD")
    pair = pair_units(src.layout, dst.layout)
    assert pair.s.dense and pair.d.dense and pair.s.rows.shape == (1, 5) and pair.d.rows.shape == (1, 5)
    assert pair.s.num_units == 8 * 1000 and pair.d.num_units == 8 * 1000


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.integers(0, 3), st.integers(0, 3))
def test_small_plan_equals_the_array_path(sc, lo, width):
    """The plain-Python path for short requests posts exactly what the numpy path posts: the same indices
    in the same order and the same descriptor count, for every mode, table and layer range."""
    src = make(
        sc["layers"], sc["p_bs"], sc["p_total"], sc["heads"], sc["p_rank"], sc["p_tp"], sc["order"], sc["pad"]
    )
    dst = make(sc["layers"], sc["d_bs"], sc["d_total"], sc["heads"], sc["d_rank"], sc["d_tp"], sc["order"])
    heads = senders_for(sc["d_rank"], sc["d_tp"], sc["p_tp"], sc["heads"])[sc["p_rank"]]
    pair = pair_units(src.layout, dst.layout, heads)
    lo = min(lo, sc["layers"])
    layers = None if width == 0 else range(lo, min(lo + width, sc["layers"]))
    s_tab = tuple(sc["p_tab"][: -(-sc["n"] // sc["p_bs"])])
    d_tab = tuple(sc["d_tab"][: -(-sc["n"] // sc["d_bs"])])
    small = prepared._small_plan(pair, s_tab, d_tab, sc["n"], layers)
    ref = prepared._array_plan(pair, s_tab, d_tab, sc["n"], layers)
    np.testing.assert_array_equal(small.src_idx, ref.src_idx)
    np.testing.assert_array_equal(small.dst_idx, ref.dst_idx)
    assert small.src_idx.dtype == ref.src_idx.dtype == np.int32
    assert (small.num_descriptors, small.nbytes, small.num_blocks) == (
        ref.num_descriptors,
        ref.nbytes,
        ref.num_blocks,
    )


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.booleans(), st.booleans(), st.booleans())
def test_halves_made_before_the_trigger_plan_the_same(sc, with_src, with_dst, stale):
    """A side planned before the other side's table arrived (prepared.half_plan) gives exactly the plan
    made in one go: the same indices, order and descriptor count; a half made for another table or token
    count is not used."""
    src = make(
        sc["layers"], sc["p_bs"], sc["p_total"], sc["heads"], sc["p_rank"], sc["p_tp"], sc["order"], sc["pad"]
    )
    dst = make(sc["layers"], sc["d_bs"], sc["d_total"], sc["heads"], sc["d_rank"], sc["d_tp"], sc["order"])
    heads = senders_for(sc["d_rank"], sc["d_tp"], sc["p_tp"], sc["heads"])[sc["p_rank"]]
    pair = pair_units(src.layout, dst.layout, heads)
    n = sc["n"]
    s_tab, d_tab = tuple(sc["p_tab"]), list(sc["d_tab"])
    made_n = n + 1 if stale and n + 1 <= len(s_tab) * sc["p_bs"] and n + 1 <= len(d_tab) * sc["d_bs"] else n
    s_half = prepared.half_plan(pair, False, s_tab, made_n) if with_src else None
    d_half = prepared.half_plan(pair, True, d_tab, made_n) if with_dst else None
    got = build_index_plan(pair, s_tab, d_tab, n, halves=(s_half, d_half))
    ref = build_index_plan(pair, s_tab, d_tab, n)
    np.testing.assert_array_equal(got.src_idx, ref.src_idx)
    np.testing.assert_array_equal(got.dst_idx, ref.dst_idx)
    assert (got.num_descriptors, got.nbytes, got.num_blocks) == (
        ref.num_descriptors,
        ref.nbytes,
        ref.num_blocks,
    )
    if made_n != n:
        return
    small = prepared._small_moved(pair, n) is not None
    assert (s_half is not None) == (with_src and small) and (d_half is not None) == (with_dst and small)
    if small:  # used, not recomputed; the destination's only where the source needed no sorting
        src_half = prepared.half_plan(pair, False, s_tab, n)
        assert src_half is not None
        assert all(b > a for a, b in itertools.pairwise(src_half.pieces))  # kept in the plan's order
        ascending = src_half.order is None
        assert (d_half is not None and got.dst_idx is d_half.idx) == (d_half is not None and ascending)
        assert (s_half is not None and got.src_idx is s_half.idx) == (s_half is not None)


def test_half_for_a_table_that_does_not_check_is_none():
    src = make(2, 16, 8, 1, 0, 1, "NHD", 0)
    dst = make(2, 16, 8, 1, 0, 1, "NHD", 0)
    pair = pair_units(src.layout, dst.layout)
    assert prepared.half_plan(pair, True, [0, 99], 20) is None  # block 99 is outside the 8-block cache
    assert prepared.half_plan(pair, True, [0, 1], 20) is not None


_TABLE = st.one_of(
    st.lists(st.integers(-2, 20), max_size=8),  # flat: ids in and out of the 16-block cache, repeats
    st.lists(st.integers(-2, 20), max_size=8).map(tuple),
    st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=4).map(tuple), min_size=1, max_size=2),
    st.lists(st.sampled_from([1, 2.0, True, np.int64(3)]), min_size=1, max_size=4),  # not plain ints
)


@settings(max_examples=400, deadline=None)
@given(_TABLE, st.integers(1, 40), st.sampled_from([(0,), (8,), (0, 0)]))
def test_plain_table_agrees_with_check_group_tables(table, n, windows):
    """The fast check answers only where check_group_tables accepts, with the same table; anything else
    (several groups, windows, ids that are not ints, any problem) falls back to the full check."""
    from kvpush.errors import LayoutError
    from kvpush.protocol.groups import as_block_ids, check_group_tables

    lay = KVLayout(
        num_layers=len(windows), block_size=4, num_blocks=16, total_kv_heads=1, head_dim=4, dtype_size=2,
        layer_group=tuple(range(len(windows))), group_window=windows,
    )  # fmt: skip
    got = prepared.plain_table(lay, table, n)
    try:
        full = check_group_tables(lay, as_block_ids(table), n, "t")
    except LayoutError:
        assert got is None
        return
    if got is not None:
        assert lay.num_groups == 1 and not lay.window(0)
        assert got == tuple(table) and all(type(b) is int for b in got)
        assert (got[: -(-n // 4)],) == full
    elif lay.num_groups == 1 and not lay.window(0) and all(type(b) is int for b in table):
        raise AssertionError("a plain table the full check accepts was not taken by the fast path")
