"""write_plan and sealed_done, the two calls the push thread makes per WRITE: one StartWrite becomes the
plan the planners would build and a TransferDone the decode rank's session opens (with the plan's byte
count); failure_notice likewise for a TransferFailed."""

from __future__ import annotations

import pytest

from kvpush.errors import LayoutError, WireError
from kvpush.protocol.handshake import Session
from kvpush.protocol.order import failure_notice, sealed_done, write_plan
from kvpush.protocol.plan import TransferPlan, build_plan
from kvpush.protocol.prepared import IndexPlan, build_index_plan, pair_units
from kvpush.protocol.sender import NotifyFailure, StartWrite
from kvpush.protocol.tp import receivers_for
from kvpush.protocol.wire import Codec, TransferDone, TransferFailed
from tests.protocol.test_plan import make

KEY = b"k" * 32


def _pair() -> tuple[Session, Session]:
    codec = Codec(1 << 20)
    d_nonce, p_nonce = b"d" * 16, b"p" * 16
    return Session(codec, KEY, d_nonce, p_nonce, "prefill"), Session(codec, KEY, d_nonce, p_nonce, "decode")


def _act(
    src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...], n: int, heads: tuple[int, int]
) -> StartWrite:
    return StartWrite("r1", 3, "D", 1, 2, src_blocks, dst_blocks, n, heads)


@pytest.mark.parametrize("prepared", [True, False])
def test_write_plan_builds_the_plan_and_sealed_done_seals_its_notification(prepared):
    src = make(2, 4, 8, 4, 0, 1, "NHD").layout
    dst = make(2, 4, 8, 4, 1, 2, "NHD").layout
    heads = receivers_for(0, 1, 2, 4)[1]
    act = _act((0, 1, 2), (5, 6, 7), 10, heads)
    units = pair_units(src, dst, heads) if prepared else None
    p_session, d_session = _pair()

    plan = write_plan(act, src, dst, units)
    notif = sealed_done(act, src.rank, plan.nbytes, p_session)

    if units is not None:
        want = build_index_plan(units, act.src_blocks, act.dst_blocks, act.num_tokens)
        assert isinstance(plan, IndexPlan)
        assert plan.src_idx.tolist() == want.src_idx.tolist()
        assert plan.dst_idx.tolist() == want.dst_idx.tolist()
    else:
        ref = build_plan(src, dst, act.src_blocks, act.dst_blocks, act.num_tokens, heads=heads)
        assert isinstance(plan, TransferPlan)
        assert plan.nbytes == ref.nbytes and plan.num_descriptors == ref.num_descriptors
    done = d_session.open(notif, b"notif")
    assert done == TransferDone(request_id="r1", attempt=3, prefill_rank=0, nbytes=plan.nbytes)
    with pytest.raises(WireError):  # sealed for the notification channel, not the side channel
        d_session.open(notif)


def test_write_plan_refuses_blocks_that_do_not_fit():
    src = make(1, 4, 4, 2, 0, 1, "NHD").layout
    dst = make(1, 4, 4, 2, 0, 1, "NHD").layout
    act = _act((0, 1), (0, 9), 8, (0, 2))  # block 9 is past the decode's 4 blocks
    with pytest.raises(LayoutError):
        write_plan(act, src, dst, pair_units(src, dst, (0, 2)))


def test_failure_notice_is_sealed_for_the_decode_and_capped():
    p_session, d_session = _pair()
    act = NotifyFailure("r1", 2, "D", 0, "x" * 5000, abandoned=True)
    msg = d_session.open(failure_notice(act, 3, p_session), b"notif")
    assert isinstance(msg, TransferFailed)
    assert (msg.request_id, msg.attempt, msg.prefill_rank, msg.abandoned) == ("r1", 2, 3, True)
    assert msg.reason == "x" * 2000


def test_sealed_done_counts_earlier_ranges_and_seals_nothing_for_a_range_before_the_last():
    p_session, d_session = _pair()
    last = StartWrite("r1", 3, "D", 1, 2, (0,), (5,), 4, (0, 2), notify=True, landed=100)
    done = d_session.open(sealed_done(last, 0, 28, p_session), b"notif")
    assert done == TransferDone(request_id="r1", attempt=3, prefill_rank=0, nbytes=128)
    earlier = StartWrite("r1", 3, "D", 1, 2, (0,), (5,), 4, (0, 2), notify=False)
    assert sealed_done(earlier, 0, 28, p_session) == b""
