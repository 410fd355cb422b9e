"""The TP maps against their definition: every head from the lowest prefill rank holding it, to every
decode rank holding it. The maps compute it in O(heads); the reference below tries every pair of ranks."""

from __future__ import annotations

import pytest

from kvpush.errors import LayoutError
from kvpush.protocol.layout import KVLayout, heads_of_rank
from kvpush.protocol.tp import check_peer_tp, receivers_for, senders_for


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
