"""What one StartWrite becomes on the wire, in one pure call: the plan and the sealed notification.

The push thread makes one trip into protocol/ per WRITE (`write_order`), and one per failure it tells a
decode rank (`failure_notice`); the sender machine, the planner and the session stay behind these two.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError
from .groups import single_table
from .handshake import Session
from .layout import KVLayout
from .plan import TransferPlan, build_plan
from .prepared import IndexPlan, PairUnits, build_index_plan
from .sender import NotifyFailure, StartWrite
from .wire import TransferDone, TransferFailed

NOTIF = b"notif"  # the session channel NIXL notifications are sealed on


@dataclass(frozen=True)
class WriteOrder:
    """Everything a WRITE needs from the protocol: which bytes go where, and the decode's notification."""

    plan: TransferPlan | IndexPlan
    notif: bytes  # TransferDone, sealed for the destination rank's session


def write_order(
    act: StartWrite, src: KVLayout, dst: KVLayout, units: PairUnits | None, session: Session
) -> WriteOrder:
    """The WRITE for `act` from this rank's layout `src` into the decode rank's `dst`: indices into the
    pair's prepared lists when it has them (`units`), else fresh descriptor lists. A streamed range
    (tokens from `act.token_start`, `act.layers`) is planned on the tables from its first block on; it
    carries the notification only when `act.notify`. LayoutError if the blocks do not fit."""
    plan = write_plan(act, src, dst, units)
    return WriteOrder(plan, sealed_done(act, src.rank, plan.nbytes, session))


def write_plan(
    act: StartWrite, src: KVLayout, dst: KVLayout, units: PairUnits | None
) -> TransferPlan | IndexPlan:
    """write_order's first half, the plan (the push thread times the two halves apart)."""
    t0 = act.token_start
    if t0 % src.block_size or t0 % dst.block_size:
        raise LayoutError(
            f"a range starting at token {t0} does not start a block on both sides "
            f"(block sizes {src.block_size} and {dst.block_size})"
        )
    src_blocks, dst_blocks = act.src_blocks, act.dst_blocks
    if t0:  # a later range of a streamed request: one full-attention group (kv_ready refuses others)
        s_tab, d_tab = single_table(src_blocks), single_table(dst_blocks)
        if s_tab is None or d_tab is None:
            raise LayoutError(
                f"a range starting at token {t0} needs one block table per side, not one per group"
            )
        src_blocks, dst_blocks = s_tab[t0 // src.block_size :], d_tab[t0 // dst.block_size :]
    n = act.num_tokens - t0
    layers = None if act.layers is None else range(*act.layers)
    if units is not None:
        return build_index_plan(units, src_blocks, dst_blocks, n, layers=layers)
    return build_plan(src, dst, src_blocks, dst_blocks, n, layers=layers, heads=act.heads)


def sealed_done(act: StartWrite, prefill_rank: int, nbytes: int, session: Session) -> bytes:
    """write_order's second half: the sealed TransferDone the WRITE carries when `act.notify` (the
    request's last range), counting the bytes that landed before it; else no notification (b"")."""
    if not act.notify:
        return b""
    return done_notice(act.request_id, act.attempt, prefill_rank, act.landed + nbytes, session)


def done_notice(request_id: str, attempt: int, prefill_rank: int, nbytes: int, session: Session) -> bytes:
    """The sealed TransferDone: every byte of this rank's part of the request landed (`nbytes` in all)."""
    done = TransferDone(request_id=request_id, attempt=attempt, prefill_rank=prefill_rank, nbytes=nbytes)
    return session.seal(done, NOTIF)


def failure_notice(act: NotifyFailure, prefill_rank: int, session: Session) -> bytes:
    """The sealed TransferFailed that tells a decode rank we will not write (or gave a WRITE up)."""
    msg = TransferFailed(
        request_id=act.request_id,
        attempt=act.attempt,
        prefill_rank=prefill_rank,
        reason=act.reason[:2000],
        abandoned=act.abandoned,
        kind=act.kind,
    )
    return session.seal(msg, NOTIF)
