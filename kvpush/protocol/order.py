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
    plan: TransferPlan | IndexPlan
    if units is not None:
        plan = build_index_plan(units, src_blocks, dst_blocks, n, layers=layers)
    else:
        plan = build_plan(src, dst, src_blocks, dst_blocks, n, layers=layers, heads=act.heads)
    if not act.notify:
        return WriteOrder(plan, b"")
    done = done_notice(act.request_id, act.attempt, src.rank, act.landed + plan.nbytes, session)
    return WriteOrder(plan, done)


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
    )
    return session.seal(msg, NOTIF)
