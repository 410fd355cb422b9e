"""Every byte of every token lands exactly once, in the right place; descriptors = maximal runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.backends.host import HostKVCache
from kvpush.protocol.layout import KVLayout, LayoutError
from kvpush.protocol.plan import build_plan
from kvpush.protocol.tp import receivers_for, senders_for


def make(
    layers: int, bs: int, blocks: int, heads: int, rank: int, tp: int, order: str, stride_pad: int = 0
) -> HostKVCache:
    lay = KVLayout(
        num_layers=layers,
        block_size=bs,
        num_blocks=blocks,
        total_kv_heads=heads,
        head_dim=4,
        dtype_size=2,
        tp_rank=rank,
        tp_size=tp,
        token_order=order,
    )  # type: ignore[arg-type]
    if stride_pad:
        lay = KVLayout(
            num_layers=layers,
            block_size=bs,
            num_blocks=blocks,
            total_kv_heads=heads,
            head_dim=4,
            dtype_size=2,
            tp_rank=rank,
            tp_size=tp,
            token_order=order,  # type: ignore[arg-type]
            block_stride=lay.block_bytes + stride_pad,
        )
    return HostKVCache(lay)


def expected_units(src: HostKVCache, dst: HostKVCache, s_tab, d_tab, n, heads):
    """Brute force: (layer, src_addr, dst_addr) of every (layer, kv, token, head) unit."""
    s, d = src.layout, dst.layout
    out = []
    for layer in range(s.num_layers):
        for kv in range(s.kv_per_layer):
            for t in range(n):
                for h in range(*heads):
                    out.append(
                        (
                            layer,
                            s.address(
                                layer, kv, s_tab[t // s.block_size], t % s.block_size, h - s.kv_heads[0]
                            ),
                            d.address(
                                layer, kv, d_tab[t // d.block_size], t % d.block_size, h - d.kv_heads[0]
                            ),
                        )
                    )
    return out


def count_runs(units, unit_bytes):
    units = sorted(units)
    runs = 0
    prev = None
    for u in units:
        if not (prev and prev[0] == u[0] and u[1] == prev[1] + unit_bytes and u[2] == prev[2] + unit_bytes):
            runs += 1
        prev = u
    return runs


def apply_plan(plan, src: HostKVCache, dst: HostKVCache) -> np.ndarray:
    """Copy like a WRITE would; return how many times each destination byte was written."""
    written = np.zeros(dst.nbytes, dtype=np.int32)
    s0, d0 = src.layout.regions[0].addr, dst.layout.regions[0].addr
    for sa, da, ln in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.length.tolist(), strict=True):
        so, do = sa - s0, da - d0
        assert so >= 0 and so + ln <= src.nbytes and do >= 0 and do + ln <= dst.nbytes
        dst.buffer[do : do + ln] = src.buffer[so : so + ln]
        written[do : do + ln] += 1
    return written


@st.composite
def scenarios(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    p_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= heads or t % heads == 0]))
    d_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= heads or t % heads == 0]))
    small = draw(st.sampled_from([1, 2, 4]))
    factor = draw(st.sampled_from([1, 2, 4]))
    p_bs, d_bs = (small, small * factor) if draw(st.booleans()) else (small * factor, small)
    n = draw(st.integers(1, 40))
    order = draw(st.sampled_from(["NHD", "HND"]))
    layers = draw(st.integers(1, 3))
    d_rank = draw(st.integers(0, d_tp - 1))
    p_rank = draw(st.sampled_from(sorted(senders_for(d_rank, d_tp, p_tp, heads))))
    pad = draw(st.sampled_from([0, 0, 8]))
    p_blocks_needed, d_blocks_needed = -(-n // p_bs), -(-n // d_bs)
    p_total = p_blocks_needed + draw(st.integers(0, 6))
    d_total = d_blocks_needed + draw(st.integers(0, 6))
    p_tab = draw(st.permutations(range(p_total)))[:p_blocks_needed]
    d_tab = draw(st.permutations(range(d_total)))[:d_blocks_needed]
    if draw(st.booleans()):  # sometimes fully contiguous tables
        p_tab, d_tab = list(range(p_blocks_needed)), list(range(d_blocks_needed))
    return dict(
        heads=heads,
        p_tp=p_tp,
        d_tp=d_tp,
        p_bs=p_bs,
        d_bs=d_bs,
        n=n,
        order=order,
        layers=layers,
        d_rank=d_rank,
        p_rank=p_rank,
        pad=pad,
        p_total=p_total,
        d_total=d_total,
        p_tab=p_tab,
        d_tab=d_tab,
    )


@settings(max_examples=250, deadline=None)
@given(scenarios())
def test_every_byte_lands_once_in_the_right_place(sc):
    src = make(
        sc["layers"], sc["p_bs"], sc["p_total"], sc["heads"], sc["p_rank"], sc["p_tp"], sc["order"], sc["pad"]
    )
    dst = make(sc["layers"], sc["d_bs"], sc["d_total"], sc["heads"], sc["d_rank"], sc["d_tp"], sc["order"])
    rng = np.random.default_rng(1)
    src.buffer[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    dst.buffer[:] = 0
    heads = senders_for(sc["d_rank"], sc["d_tp"], sc["p_tp"], sc["heads"])[sc["p_rank"]]
    plan = build_plan(src.layout, dst.layout, sc["p_tab"], sc["d_tab"], sc["n"], heads=heads)

    written = apply_plan(plan, src, dst)
    units = expected_units(src, dst, sc["p_tab"], sc["d_tab"], sc["n"], heads)
    unit = src.layout.unit_bytes
    expect_mask = np.zeros(dst.nbytes, dtype=bool)
    d0, s0 = dst.layout.regions[0].addr, src.layout.regions[0].addr
    for _layer, sa, da in units:
        np.testing.assert_array_equal(
            dst.buffer[da - d0 : da - d0 + unit], src.buffer[sa - s0 : sa - s0 + unit]
        )
        expect_mask[da - d0 : da - d0 + unit] = True
    assert (written[expect_mask] == 1).all(), "a destination byte was written twice or not at all"
    assert (written[~expect_mask] == 0).all(), "bytes outside the request's units were written"
    assert plan.nbytes == len(units) * unit
    assert plan.num_descriptors == count_runs(units, unit)
    for layer, sl in plan.layer_slices().items():
        assert (plan.layer[sl] == layer).all()


def test_contiguous_16k_request_is_one_descriptor_per_plane():
    lay = dict(num_layers=64, total_kv_heads=1, head_dim=128, dtype_size=2)
    src = HostKVCache(KVLayout(block_size=16, num_blocks=1000, **lay))
    dst = HostKVCache(KVLayout(block_size=32, num_blocks=500, **lay))
    plan = build_plan(src.layout, dst.layout, range(1000), range(500), 16000)
    assert plan.num_blocks == 1000
    # every block is used, so K and V planes of a layer are adjacent: one run per layer, not 2000 blocks
    assert plan.num_descriptors == 64
    assert plan.nbytes == 16000 * 64 * 2 * 256


def test_bad_tables_and_layouts_are_refused_with_a_named_reason():
    a = HostKVCache(
        KVLayout(num_layers=2, block_size=16, num_blocks=4, total_kv_heads=2, head_dim=4, dtype_size=2)
    )
    b = HostKVCache(
        KVLayout(num_layers=3, block_size=16, num_blocks=4, total_kv_heads=2, head_dim=4, dtype_size=2)
    )
    c = HostKVCache(
        KVLayout(num_layers=2, block_size=24, num_blocks=4, total_kv_heads=2, head_dim=4, dtype_size=2)
    )
    with pytest.raises(LayoutError, match="num_layers"):
        build_plan(a.layout, b.layout, [0], [0], 10)
    with pytest.raises(LayoutError, match="divide"):
        build_plan(a.layout, c.layout, [0], [0], 10)
    with pytest.raises(LayoutError, match="needed"):
        build_plan(a.layout, a.layout, [0], [0], 20)
    with pytest.raises(LayoutError, match="outside"):
        build_plan(a.layout, a.layout, [7], [0], 10)
    with pytest.raises(LayoutError, match="repeats"):
        build_plan(a.layout, a.layout, [0, 0], [0, 1], 20)


def test_tp_mapping_counts():
    # prefill TP4, decode TP2, 4 heads: each decode rank hears from two prefill ranks
    assert senders_for(0, 2, 4, 4) == {0: (0, 1), 1: (1, 2)}
    assert receivers_for(3, 4, 2, 4) == {1: (3, 4)}
    # prefill TP8 replicating 2 heads: only the lowest replica writes
    assert senders_for(0, 1, 8, 2) == {0: (0, 1), 4: (1, 2)}
    # prefill TP1, decode TP2: one sender per decode rank
    assert senders_for(1, 2, 1, 2) == {0: (1, 2)}
