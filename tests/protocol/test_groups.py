"""Issue 19 core: MLA latents over TP, 1-byte dtypes, KV-cache groups with sliding windows (the window
boundary case by name), PP stages (layer subsets), the refusals by name, and a property test that a plan
writes exactly the in-window bytes. Every byte is checked by running the plan (and the prepared-list index
plan) as a memcpy between two buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.errors import LayoutError
from kvpush.protocol.groups import HOLE, check_group_tables, window_token_range
from kvpush.protocol.handshake import check_peer_hello, make_hello
from kvpush.protocol.layout import KVLayout, blocks_for, check_compatible
from kvpush.protocol.plan import build_plan
from kvpush.protocol.prepared import build_index_plan, pair_units
from kvpush.protocol.tp import receivers_for, senders_for, stage_senders
from kvpush.protocol.wire import Codec, Registration

from .kvbytes import expected, fill, placed, run_index_plan, run_plan

SRC, DST = 0x100000, 0x9000000


def _layout(**kw: object) -> KVLayout:
    base: dict[str, object] = dict(
        num_layers=4, block_size=4, num_blocks=32, total_kv_heads=2, head_dim=4, dtype_size=2
    )
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


def _window_table(n: int, window: int, bs: int, ids: list[int]) -> tuple[int, ...]:
    """A table of ids with holes where the window needs no block (as an engine that freed them)."""
    first, _ = window_token_range(n, window, 1)
    need_from = first // bs
    return tuple(HOLE if i < need_from else b for i, b in enumerate(ids[: blocks_for(n, bs)]))


def _push_both_ways(src: KVLayout, dst: KVLayout, s_tabs, d_tabs, n, heads=None, layers=None):
    """Run build_plan and the index plan from a filled source; return both decode buffers."""
    src, sbuf = placed(src, SRC)
    dst, dbuf = placed(dst, DST)
    fill(sbuf, src, s_tabs, n, tag=3)
    plan = build_plan(
        src,
        dst,
        s_tabs if len(s_tabs) > 1 else s_tabs[0],
        d_tabs if len(d_tabs) > 1 else d_tabs[0],
        n,
        heads=heads,
    )
    run_plan(plan, src, sbuf, dst, dbuf)
    pair = pair_units(src, dst, heads)
    ibuf = np.zeros_like(dbuf)
    iplan = build_index_plan(pair, s_tabs, d_tabs, n)
    run_index_plan(iplan, pair, sbuf, ibuf)
    assert iplan.nbytes == plan.nbytes
    return dst, dbuf, ibuf, pair


# ---- MLA: one latent plane, replicated over TP --------------------------------------------------------
def test_mla_tp_maps_pick_one_source_rank():
    # prefill TP 2 -> decode TP 1: only prefill rank 0 writes; rank 1 owes nothing
    assert senders_for(0, 1, 2, 1) == {0: (0, 1)}
    assert receivers_for(0, 2, 1, 1) == {0: (0, 1)} and receivers_for(1, 2, 1, 1) == {}
    # prefill TP 1 -> decode TP 2: rank 0 writes the whole latent to both decode ranks
    assert receivers_for(0, 1, 2, 1) == {0: (0, 1), 1: (0, 1)}
    assert senders_for(1, 2, 1, 1) == {0: (0, 1)}


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_mla_latent_rows_move_byte_exact(p_tp, d_tp):
    mla = dict(kv_per_layer=1, total_kv_heads=1, head_dim=576, dtype_size=2, block_size=16, num_blocks=8)
    n = 37
    s_tab, d_tab = (5, 1, 7), (2, 6, 0)
    for d_rank in range(d_tp):
        owners = senders_for(d_rank, d_tp, p_tp, 1)
        assert list(owners) == [0]  # exactly one prefill rank writes each decode rank
        src = _layout(tp_rank=0, tp_size=p_tp, **mla)
        dst = _layout(tp_rank=d_rank, tp_size=d_tp, **mla)
        dst, dbuf, ibuf, _ = _push_both_ways(src, dst, (s_tab,), (d_tab,), n, heads=owners[0])
        want = expected(dst, (d_tab,), n, 3, (0, 1), set(range(4)))
        assert (dbuf == want).all() and (ibuf == want).all()


# ---- 1-byte dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("order, p_tp", [("NHD", 1), ("HND", 1), ("NHD", 2)])
def test_fp8_one_byte_units_move_byte_exact(order, p_tp):
    n = 23
    src = _layout(dtype_size=1, head_dim=3, token_order=order, tp_size=p_tp)  # 3-byte units: no alignment
    dst = _layout(dtype_size=1, head_dim=3, token_order=order, block_size=8, num_blocks=16)
    heads = src.kv_heads
    dst, dbuf, ibuf, _ = _push_both_ways(src, dst, ((9, 3, 4, 20, 21, 22),), ((1, 5, 2),), n, heads=heads)
    want = expected(dst, ((1, 5, 2),), n, 3, heads, set(range(4)))
    assert (dbuf == want).all() and (ibuf == want).all()
    assert src.unit_bytes == 3 and src.compat_hash() != _layout(head_dim=3, token_order=order).compat_hash()


# ---- KV-cache groups and sliding windows --------------------------------------------------------------
GROUPS = dict(num_layers=6, layer_group=(0, 1, 2, 1, 2, 0), group_window=(0, 8, 12))


@pytest.mark.parametrize("n", [5, 11, 12, 15, 23, 31])  # 11 and 15 and 23 and 31: n % 4 == 3
def test_three_groups_move_only_their_windows(n):
    src = _layout(**GROUPS)
    dst = _layout(block_size=8, num_blocks=16, **GROUPS)
    ids_s = [30, 2, 17, 9, 11, 12, 13, 14]
    ids_d = [7, 3, 1, 15]
    s_tabs = (tuple(ids_s[: blocks_for(n, 4)]), *(_window_table(n, w, 4, ids_s[::-1]) for w in (8, 12)))
    d_tabs = (tuple(ids_d[: blocks_for(n, 8)]), *(_window_table(n, w, 8, ids_d[::-1]) for w in (8, 12)))
    dst, dbuf, ibuf, pair = _push_both_ways(src, dst, s_tabs, d_tabs, n)
    assert (dbuf == expected(dst, d_tabs, n, 3, (0, 2), set(range(6)))).all()
    assert (ibuf == expected(dst, d_tabs, n, 3, (0, 2), set(range(6)), align=pair.chunk)).all()


def test_window_boundary_case_moves_the_oldest_in_window_block():
    """n % block_size == block_size - 1: the oldest token of the window is alone in its block. The plan
    moves it; an engine that dropped that block (a hole there) is refused by name, not decoded."""
    bs, window, n = 4, 8, 11
    assert window_token_range(n, window, 1) == (3, 11)  # tokens 3..10: token 3 is alone in block 0
    assert window_token_range(n, window, bs) == (0, 11)
    src = _layout(num_layers=2, layer_group=(0, 1), group_window=(0, window))
    dst = _layout(num_layers=2, layer_group=(0, 1), group_window=(0, window))
    full, win = (4, 5, 6), (1, 2, 3)
    dst_p, dbuf, ibuf, _ = _push_both_ways(src, dst, (full, win), (full, (8, 9, 10)), n)
    want = expected(dst_p, (full, (8, 9, 10)), n, 3, (0, 2), {0, 1})
    assert (dbuf == want).all()
    assert (ibuf == expected(dst_p, (full, (8, 9, 10)), n, 3, (0, 2), {0, 1}, align=bs)).all()  # whole units
    assert want[dst_p.plane(1, 0).offset + 8 * dst_p.block_stride :][: dst_p.block_bytes].any()  # token 3
    with pytest.raises(
        LayoutError, match=r"prefill: KV-cache group 1: block 0 of the table is -1 .*window 8"
    ):
        build_plan(*_placed_pair(src, dst), (full, (HOLE, 2, 3)), (full, win), n)
    with pytest.raises(LayoutError, match=r"decode: KV-cache group 1: block 0 of the table is -1"):
        build_plan(*_placed_pair(src, dst), (full, win), (full, (HOLE, 2, 3)), n)
    # one token more and block 0 is outside the window: a hole there is fine on both sides
    build_plan(*_placed_pair(src, dst), ((*full, 7), (HOLE, 2, 3, 4)), ((*full, 7), (HOLE, 9, 10, 11)), n + 1)


def _placed_pair(src: KVLayout, dst: KVLayout) -> tuple[KVLayout, KVLayout]:
    return placed(src, SRC)[0], placed(dst, DST)[0]


def test_prompt_longer_than_the_window_moves_only_the_window():
    src = _layout(num_layers=1, layer_group=(0,), group_window=(8,))
    n = 30  # window 8: tokens 22..29, blocks 5..7 of 8
    table = _window_table(n, 8, 4, list(range(8)))
    assert table[:5] == (HOLE,) * 5
    s, d = _placed_pair(src, src)
    plan = build_plan(s, d, (table,), (table,), n)
    assert plan.nbytes == 8 * 2 * 2 * src.unit_bytes  # 8 tokens x 2 heads x K,V


def test_a_hole_in_a_full_attention_group_is_refused_by_name():
    lay = _layout(num_layers=2, layer_group=(0, 1), group_window=(0, 8))
    with pytest.raises(LayoutError, match="group 0: block 1 of the table is -1 .*full attention"):
        check_group_tables(lay, ((1, HOLE, 3), (4, 5, 6)), 9, "prefill")
    with pytest.raises(LayoutError, match="one block table for a layout of 2 KV-cache groups"):
        check_group_tables(lay, (1, 2, 3), 9, "prefill")
    with pytest.raises(LayoutError, match="repeats"):
        check_group_tables(lay, ((1, 2, 3), (4, 5, 5)), 9, "prefill")


# ---- PP: a prefill stage holds a subset of the decode's layers -----------------------------------------
def test_pp_stages_each_write_their_layers_into_one_decode():
    dst = _layout(num_layers=4)
    n, s_tab, d_tab = 13, (3, 4, 5, 6), (10, 11, 12, 13)
    dst_p, dbuf = placed(dst, DST)
    for stage, layers in enumerate(((0, 1), (2, 3))):
        src = _layout(num_layers=2, layer_ids=layers, pp_rank=stage, pp_size=2)
        assert src.rank == stage
        src_p, sbuf = placed(src, SRC + stage * 0x100000)
        fill(sbuf, src_p, (s_tab,), n, tag=3)
        run_plan(build_plan(src_p, dst_p, s_tab, d_tab, n), src_p, sbuf, dst_p, dbuf)
        if stage == 0:  # only stage 0's layers have landed
            assert (dbuf == expected(dst_p, (d_tab,), n, 3, (0, 2), {0, 1})).all()
    assert (dbuf == expected(dst_p, (d_tab,), n, 3, (0, 2), {0, 1, 2, 3})).all()
    # the decode waits for one notification per (stage, source rank), numbered globally
    assert stage_senders(0, 1, 2, 2, 2) == {0: (0, 1), 1: (1, 2), 2: (0, 1), 3: (1, 2)}
    assert stage_senders(1, 2, 1, 3, 2) == {0: (1, 2), 1: (1, 2), 2: (1, 2)}


# ---- refusals by name at the handshake -----------------------------------------------------------------
@pytest.mark.parametrize(
    "src_kw, dst_kw, match",
    [
        (
            dict(group_window=(0, 8), layer_group=(0, 1, 0, 1)),
            dict(group_window=(0, 8, 8), layer_group=(0, 1, 2, 1)),
            "prefill has 2 KV-cache groups, decode 3",
        ),
        (
            dict(group_window=(0, 64), layer_group=(0, 1, 0, 1)),
            dict(group_window=(0, 128), layer_group=(0, 1, 0, 1)),
            "KV-cache group 1 sliding window window 64 .prefill. vs window 128",
        ),
        (
            dict(group_window=(0, 8), layer_group=(0, 1, 0, 1)),
            dict(group_window=(0, 8), layer_group=(0, 1, 1, 0)),
            "layer 2 is in KV-cache group 0 on prefill, 1 on decode",
        ),
        (
            dict(num_layers=4, layer_ids=(0, 1, 2, 3), pp_rank=0, pp_size=2),
            dict(num_layers=3),
            "prefill stage 0 layers 0-3 not all held by the decode .it holds 0-2; missing 3",
        ),
        (dict(dtype_size=1), dict(dtype_size=2), "prefill dtype_size=1 but decode dtype_size=2"),
        (dict(kv_per_layer=1, total_kv_heads=1), dict(kv_per_layer=2, total_kv_heads=1), "kv_per_layer"),
    ],
)
def test_impossible_pairings_are_refused_at_the_handshake_by_name(src_kw, dst_kw, match):
    src, dst = _placed_pair(_layout(**src_kw), _layout(**dst_kw))
    with pytest.raises(LayoutError, match=match):
        check_compatible(src, dst)
    hello = make_hello("p", "prefill", "agent", b"", "DRAM", src)
    with pytest.raises(LayoutError, match=match):
        check_peer_hello(dst, hello, prefill_side=False)  # the decode refuses the prefill's Hello


def test_layouts_with_groups_and_stages_survive_the_wire():
    lay = placed(
        _layout(
            layer_ids=(4, 5, 6, 7),
            pp_rank=1,
            pp_size=2,
            layer_group=(0, 1, 0, 1),
            group_window=(0, 32),
            dtype_size=1,
        ),
        SRC,
    )[0]
    hello = Codec().decode(Codec().encode(make_hello("p", "prefill", "a", b"", "DRAM", lay)))
    dst = placed(_layout(num_layers=8, layer_group=(0, 1) * 4, group_window=(0, 32), dtype_size=1), DST)[0]
    assert check_peer_hello(dst, hello, prefill_side=False) == lay
    assert lay.compat_hash() != _layout(dtype_size=1).compat_hash()


def test_registration_carries_per_group_tables():
    reg = Registration(
        request_id="r",
        attempt=0,
        decode_engine_id="d",
        decode_rank=0,
        decode_tp=1,
        block_ids=[1, 2, -1, 3],
        num_tokens=5,
        expires_at=1.0,
        group_sizes=[2, 2],
    )
    back = Codec().decode(Codec().encode(reg))
    assert isinstance(back, Registration) and back.tables() == ((1, 2), (-1, 3))
    flat = Registration(
        request_id="r",
        attempt=0,
        decode_engine_id="d",
        decode_rank=0,
        decode_tp=1,
        block_ids=[1, 2],
        num_tokens=5,
        expires_at=1.0,
    )
    assert flat.tables() == (1, 2)
    with pytest.raises(ValueError, match="group_sizes add up to 3 block ids but block_ids holds 4"):
        Registration(
            request_id="r",
            attempt=0,
            decode_engine_id="d",
            decode_rank=0,
            decode_tp=1,
            block_ids=[1, 2, -1, 3],
            num_tokens=5,
            expires_at=1.0,
            group_sizes=[1, 2],
        )


# ---- property: exactly the in-window bytes -------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    bs_s=st.sampled_from([1, 2, 4, 8]),
    bs_d=st.sampled_from([1, 2, 4, 8]),
    window=st.integers(0, 40),
    n=st.integers(1, 48),
    order=st.sampled_from(["NHD", "HND"]),
)
def test_plan_writes_exactly_the_in_window_bytes(bs_s, bs_d, window, n, order):
    if max(bs_s, bs_d) % min(bs_s, bs_d):
        return
    kw = dict(
        num_layers=2,
        layer_group=(0, 1),
        group_window=(0, window),
        num_blocks=64,
        token_order=order,
        head_dim=2,
    )
    src, dst = _layout(block_size=bs_s, **kw), _layout(block_size=bs_d, **kw)
    s_full = tuple(range(63, 63 - blocks_for(n, bs_s), -1))
    d_full = tuple(range(blocks_for(n, bs_d)))
    s_tabs = (
        (s_full, _window_table(n, window, bs_s, [b - 1 for b in s_full]))
        if window
        else (s_full, s_full[::-1])
    )
    d_tabs = (
        (d_full, _window_table(n, window, bs_d, [b + 1 for b in d_full]))
        if window
        else (d_full, d_full[::-1])
    )
    dst_p, dbuf, ibuf, pair = _push_both_ways(src, dst, s_tabs, d_tabs, n)
    assert (dbuf == expected(dst_p, d_tabs, n, 3, (0, 2), {0, 1})).all()
    # the index plan moves whole units: the window's first unit may start a little earlier, inside a needed block
    assert (ibuf == expected(dst_p, d_tabs, n, 3, (0, 2), {0, 1}, align=pair.chunk)).all()
