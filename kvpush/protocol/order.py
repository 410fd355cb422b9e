"""What one StartWrite and one NotifyFailure become on the wire: pure calls the push thread makes.

A WRITE is two calls, which the push thread makes (and times) apart, and between which it may also plan
by itself (a side prepared before the trigger) or make the WRITE ahead of prefill_done: `write_plan`
(which bytes go where: indices into the pair's prepared lists, or fresh descriptor lists) and
`sealed_done` (the TransferDone the WRITE carries, sealed for the decode rank's session). A failure the
decode rank must hear of is one call, `failure_notice`.
"""

from __future__ import annotations

from ..errors import LayoutError
from .groups import single_table
from .handshake import Session
from .layout import KVLayout
from .plan import TransferPlan, build_plan
from .prepared import IndexPlan, PairUnits, build_index_plan
from .sender import NotifyFailure, StartWrite
from .wire import TransferDone, TransferFailed

NOTIF = b"notif"  # the session channel NIXL notifications are sealed on


def write_plan(
    act: StartWrite, src: KVLayout, dst: KVLayout, units: PairUnits | None
) -> TransferPlan | IndexPlan:
    """The plan of `act`'s WRITE from this rank's layout `src` into the decode rank's `dst`: indices into
    the pair's prepared lists when it has them (`units`), else fresh descriptor lists. A streamed range
    (tokens from `act.token_start`, `act.layers`) is planned on the tables from its first block on.
    LayoutError if the blocks do not fit."""
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
    """The sealed TransferDone the WRITE carries when `act.notify` (the request's last range), counting
    the bytes that landed before it; else no notification (b"")."""
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
