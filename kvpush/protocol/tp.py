"""Which prefill TP rank writes which KV heads to which decode TP rank.

Each decode rank receives exactly the heads it holds, each head from one prefill rank (the lowest one
holding it, when prefill replicates heads). The number of notifications a decode rank waits for is the
number of distinct prefill ranks that write to it.

Both maps cost O(heads involved), never O(TP size): the TP a peer declares in its Hello is bounded
(limits.max_peer_tp), yet a registration must not cost the push thread work that grows with it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from ..errors import LayoutError
from .layout import KVLayout, heads_of_rank, span_text

HeadRange = tuple[int, int]
MAX_STAGES = 256  # prefill pipeline stages a decode waits on


def _owner(head: int, prefill_tp: int, total_kv_heads: int) -> int:
    """The lowest prefill rank holding `head` (the one that writes it)."""
    if prefill_tp <= total_kv_heads:
        return head // (total_kv_heads // prefill_tp)
    return head * (prefill_tp // total_kv_heads)


def _holders(head: int, tp: int, total_kv_heads: int) -> range:
    """Every rank of a TP group that holds `head` (several when heads are replicated)."""
    if tp <= total_kv_heads:
        rank = head // (total_kv_heads // tp)
        return range(rank, rank + 1)
    rep = tp // total_kv_heads
    return range(head * rep, head * rep + rep)


def senders_for(
    decode_rank: int, decode_tp: int, prefill_tp: int, total_kv_heads: int
) -> dict[int, HeadRange]:
    """prefill rank -> global head range it writes to `decode_rank`."""
    heads_of_rank(0, prefill_tp, total_kv_heads)  # LayoutError if the heads do not split over prefill TP
    d_lo, d_hi = heads_of_rank(decode_rank, decode_tp, total_kv_heads)
    out: dict[int, HeadRange] = {}
    for head in range(d_lo, d_hi):
        owner = _owner(head, prefill_tp, total_kv_heads)
        lo, _ = out.get(owner, (head, head))
        out[owner] = (lo, head + 1)
    return out


def receivers_for(
    prefill_rank: int, prefill_tp: int, decode_tp: int, total_kv_heads: int
) -> dict[int, HeadRange]:
    """decode rank -> global head range `prefill_rank` writes to it."""
    heads_of_rank(0, decode_tp, total_kv_heads)  # LayoutError if the heads do not split over decode TP
    p_lo, p_hi = heads_of_rank(prefill_rank, prefill_tp, total_kv_heads)
    out: dict[int, HeadRange] = {}
    for head in range(p_lo, p_hi):
        if _owner(head, prefill_tp, total_kv_heads) != prefill_rank:
            continue  # a lower prefill rank holds this head too and writes it
        for d in _holders(head, decode_tp, total_kv_heads):
            lo, _ = out.get(d, (head, head))
            out[d] = (lo, head + 1)
    return dict(sorted(out.items()))


# The push thread asks both maps for every registration (and the sender for each handshake); they are
# pure functions of four ints from a handshake-bounded set, so they are computed once per TP pair. A
# cached call runs no Python: on a push thread woken cold, every function it enters costs pages.
@functools.lru_cache(maxsize=512)
def owed_heads(
    prefill_rank: int, prefill_tp: int, decode_tp: int, total_kv_heads: int
) -> Mapping[int, HeadRange]:
    """receivers_for, computed once and read-only (a LayoutError is raised again on every call)."""
    return MappingProxyType(receivers_for(prefill_rank, prefill_tp, decode_tp, total_kv_heads))


@functools.lru_cache(maxsize=512)
def writer_ranks(decode_rank: int, decode_tp: int, prefill_tp: int, total_kv_heads: int) -> frozenset[int]:
    """The prefill ranks that write to `decode_rank` (the keys of senders_for), computed once."""
    return frozenset(senders_for(decode_rank, decode_tp, prefill_tp, total_kv_heads))


def check_peer_tp(peer: KVLayout, max_peer_tp: int) -> None:
    """LayoutError naming the TP a peer's Hello declared when it is over the bound (or does not split the
    KV heads): the maps above cost work per rank of the peer's TP, so it is checked before any."""
    if peer.tp_size > max_peer_tp:
        raise LayoutError(
            f"peer declares TP {peer.tp_size} with {peer.total_kv_heads} KV heads: over this side's "
            f"limits.max_peer_tp {max_peer_tp}"
        )
    heads_of_rank(peer.tp_rank, peer.tp_size, peer.total_kv_heads)


def stage_senders(
    decode_rank: int, decode_tp: int, prefill_tp: int, prefill_pp: int, total_kv_heads: int
) -> dict[int, HeadRange]:
    """Global prefill rank (stage x prefill_tp + TP rank) -> head range it writes to `decode_rank`: every
    pipeline stage's ranks write their own layers, so the decode waits for one notification per (stage,
    source rank). With prefill_pp 1 this is `senders_for`."""
    if not 1 <= prefill_pp <= MAX_STAGES:
        raise LayoutError(f"prefill PP {prefill_pp}: kvpush pairs with 1..{MAX_STAGES} pipeline stages")
    per_stage = senders_for(decode_rank, decode_tp, prefill_tp, total_kv_heads)
    return {
        stage * prefill_tp + r: heads for stage in range(prefill_pp) for r, heads in sorted(per_stage.items())
    }


def owes_nothing(prefill_rank: int, prefill_tp: int, total_kv_heads: int) -> bool:
    """True when a lower prefill rank holds (and writes) every head this rank holds: MLA's replicated latent
    or replicated GQA heads on ranks past the first copy. It owes no decode rank anything, whatever the
    decode's TP (the writer of a head is chosen by prefill TP alone), so no decode ever registers with it."""
    lo, hi = heads_of_rank(prefill_rank, prefill_tp, total_kv_heads)
    return all(_owner(head, prefill_tp, total_kv_heads) != prefill_rank for head in range(lo, hi))


def check_stage(peer: KVLayout, rank: int, prefill_tp: int, prefill_pp: int) -> None:
    """LayoutError unless the prefill rank that answered at global rank `rank` is the one the decode was
    told about (a PrefillAddress with prefill_tp x prefill_pp ranks): a stage left out of the address
    leaves its layers unwritten, yet each stage alone passes check_compatible."""
    if peer.pp_size != prefill_pp or (prefill_pp > 1 and peer.tp_size != prefill_tp):  # PP numbers by TP
        raise LayoutError(
            f"prefill rank {rank} runs PP {peer.pp_size} x TP {peer.tp_size}, but the decode was given "
            f"PP {prefill_pp} x TP {prefill_tp} (PrefillAddress.pp_size / tp_size): a stage left out "
            "would leave its layers unwritten"
        )
    if peer.rank != rank:
        raise LayoutError(
            f"prefill rank {rank} answered as stage {peer.pp_rank} rank {peer.tp_rank} (global rank "
            f"{peer.rank}): its ports are numbered otherwise"
        )


def check_stage_coverage(decode_layers: Sequence[int], stages: Mapping[int, Sequence[int]]) -> None:
    """LayoutError unless the prefill stages (stage -> the model layers it holds) hold every decode layer
    exactly once: a layer no stage holds would be reported ready unwritten, one held twice written twice."""
    owner: dict[int, int] = {}
    for stage, layers in sorted(stages.items()):
        for layer in layers:
            if layer in owner:
                raise LayoutError(
                    f"layout mismatch: layer {layer} is held by prefill stages {owner[layer]} and {stage}"
                )
            owner[layer] = stage
    missing = sorted(set(decode_layers) - set(owner))
    if missing:
        held = "; ".join(f"stage {s} holds {span_text(ls)}" for s, ls in sorted(stages.items()))
        raise LayoutError(
            f"layout mismatch: no prefill stage holds decode layers {span_text(missing)} ({held}): "
            "they would stay unwritten"
        )
