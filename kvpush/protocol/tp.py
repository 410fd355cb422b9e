"""Which prefill TP rank writes which KV heads to which decode TP rank.

Each decode rank receives exactly the heads it holds, each head from one prefill rank (the lowest one
holding it, when prefill replicates heads). The number of notifications a decode rank waits for is the
number of distinct prefill ranks that write to it.
"""

from __future__ import annotations

from .layout import heads_of_rank

HeadRange = tuple[int, int]


def senders_for(
    decode_rank: int, decode_tp: int, prefill_tp: int, total_kv_heads: int
) -> dict[int, HeadRange]:
    """prefill rank -> global head range it writes to `decode_rank`."""
    d_lo, d_hi = heads_of_rank(decode_rank, decode_tp, total_kv_heads)
    owners: dict[int, list[int]] = {}
    for head in range(d_lo, d_hi):
        owner = min(
            p
            for p in range(prefill_tp)
            if heads_of_rank(p, prefill_tp, total_kv_heads)[0]
            <= head
            < heads_of_rank(p, prefill_tp, total_kv_heads)[1]
        )
        owners.setdefault(owner, []).append(head)
    return {p: (min(hs), max(hs) + 1) for p, hs in sorted(owners.items())}


def receivers_for(
    prefill_rank: int, prefill_tp: int, decode_tp: int, total_kv_heads: int
) -> dict[int, HeadRange]:
    """decode rank -> global head range `prefill_rank` writes to it."""
    out: dict[int, HeadRange] = {}
    for d in range(decode_tp):
        heads = senders_for(d, decode_tp, prefill_tp, total_kv_heads).get(prefill_rank)
        if heads is not None:
            out[d] = heads
    return out
