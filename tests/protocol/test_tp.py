"""The TP maps against their definition: every head from the lowest prefill rank holding it, to every
decode rank holding it. The maps compute it in O(heads); the reference below tries every pair of ranks."""

from __future__ import annotations

import pytest

from kvpush.errors import LayoutError
from kvpush.protocol.layout import KVLayout, heads_of_rank
from kvpush.protocol.sender import ReleaseSource, SenderState
from kvpush.protocol.tp import (
    check_peer_tp,
    check_stage,
    check_stage_coverage,
    owes_nothing,
    receivers_for,
    senders_for,
)
from kvpush.protocol.wire import Registration


def _holds(rank: int, tp: int, heads: int, head: int) -> bool:
    lo, hi = heads_of_rank(rank, tp, heads)
    return lo <= head < hi


def reference(prefill_tp: int, decode_tp: int, heads: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(prefill rank, decode rank) -> head range, by definition."""
    out: dict[tuple[int, int], list[int]] = {}
    for head in range(heads):
        writer = min(p for p in range(prefill_tp) if _holds(p, prefill_tp, heads, head))
        for d in range(decode_tp):
            if _holds(d, decode_tp, heads, head):
                out.setdefault((writer, d), []).append(head)
    return {k: (min(v), max(v) + 1) for k, v in out.items()}


def splits(heads: int) -> list[int]:
    return [t for t in range(1, 4 * heads + 1) if (heads % t == 0 if t <= heads else t % heads == 0)]


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8])
def test_both_maps_match_the_definition_for_every_tp_pair(heads):
    for ptp in splits(heads):
        for dtp in splits(heads):
            want = reference(ptp, dtp, heads)
            for d in range(dtp):
                assert senders_for(d, dtp, ptp, heads) == {p: r for (p, dd), r in want.items() if dd == d}
            for p in range(ptp):
                got = receivers_for(p, ptp, dtp, heads)
                assert got == {d: r for (pp, d), r in want.items() if pp == p}
                assert list(got) == sorted(got)


def test_tps_that_do_not_split_the_heads_are_refused():
    with pytest.raises(LayoutError):
        senders_for(0, 2, 3, 4)
    with pytest.raises(LayoutError):
        receivers_for(0, 2, 3, 4)


def test_a_peer_tp_over_the_bound_is_refused_by_name():
    peer = KVLayout(2, 4, 8, 2, 8, 2, tp_rank=0, tp_size=65536)
    with pytest.raises(LayoutError, match=r"TP 65536 with 2 KV heads.*max_peer_tp 256"):
        check_peer_tp(peer, 256)
    check_peer_tp(KVLayout(2, 4, 8, 2, 8, 2, tp_rank=0, tp_size=256), 256)


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_a_rank_owes_nothing_exactly_when_no_decode_tp_names_it(heads):
    """owes_nothing is decided by prefill TP alone: the reference over every decode TP agrees."""
    for p_tp in splits(heads):
        for p in range(p_tp):
            named = any((p, d) in reference(p_tp, d_tp, heads) for d_tp in splits(heads) for d in range(d_tp))
            assert owes_nothing(p, p_tp, heads) is (not named), (p, p_tp, heads)
    assert owes_nothing(1, 2, 1) and not owes_nothing(0, 2, 1)  # MLA TP 2: rank 1 holds a copy only


def test_a_rank_that_owes_nothing_releases_at_prefill_done_ok_and_refuses_registrations():
    s = SenderState(1, 2, 1, lease_s=30.0, tombstone_s=60.0, num_layers=3)
    acts = s.on_prefill_done("r", (4, 5), 20, now=0.0, decode_engine_id="D")
    assert acts == [ReleaseSource("r", (4, 5), True, 0, owed_nothing=True)]
    assert len(s) == 0  # nothing held until a lease
    assert s.on_kv_ready("q", (1,), 8, None, now=0.0) == [] and len(s) == 0
    reg = Registration(
        request_id="x", attempt=1, decode_engine_id="D", decode_rank=0, decode_tp=1,
        block_ids=[1], num_tokens=4, expires_at=99.0,
    )  # fmt: skip
    (refused,) = s.on_registration(reg, now=0.0)
    assert "owes no decode rank" in refused.reason and len(s) == 0
    owing = SenderState(0, 2, 1, lease_s=30.0, tombstone_s=60.0, num_layers=3)
    assert owing.on_prefill_done("r", (4, 5), 20, now=0.0) == []  # waits for the decode's registration


def _stage(pp_rank: int, layers: tuple[int, ...], pp: int = 2, tp: int = 1, tp_rank: int = 0) -> KVLayout:
    return KVLayout(
        len(layers),
        16,
        8,
        2,
        8,
        2,
        tp_rank=tp_rank,
        tp_size=tp,
        layer_ids=layers,
        pp_rank=pp_rank,
        pp_size=pp,
    )


def test_a_stage_that_is_not_the_one_the_address_names_is_refused():
    check_stage(_stage(1, (2, 3)), 1, 1, 2)
    with pytest.raises(LayoutError, match=r"runs PP 2 x TP 1, but the decode was given PP 1 x TP 1"):
        check_stage(_stage(0, (0, 1)), 0, 1, 1)  # a PP 2 prefill addressed as PP 1: stage 1 left out
    with pytest.raises(LayoutError, match=r"prefill rank 0 answered as stage 1 rank 0"):
        check_stage(_stage(1, (2, 3)), 0, 1, 2)


def test_stages_must_hold_every_decode_layer_once():
    check_stage_coverage(range(4), {0: (0, 1), 1: (2, 3)})
    with pytest.raises(
        LayoutError, match=r"no prefill stage holds decode layers 2 \(stage 0 holds 0-1; stage 1"
    ):
        check_stage_coverage(range(4), {0: (0, 1), 1: (3,)})
    with pytest.raises(LayoutError, match=r"layer 1 is held by prefill stages 0 and 1"):
        check_stage_coverage(range(4), {0: (0, 1), 1: (1, 2, 3)})
