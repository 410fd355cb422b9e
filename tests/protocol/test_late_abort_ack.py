"""A decode's abort that arrives after the prefill abandoned the WRITE into that attempt must be answered
"abandoned" (the decode then keeps its blocks until the fence), never with a plain ack: the network may
deliver the ack before the prefill's own "abandoned" word, and a plain ack frees blocks a late WRITE may
still land in (found by tests/protocol/test_protocol_sim.py's random schedules)."""

from __future__ import annotations

import pytest

from kvpush.protocol.sender import NotifyFailure, ReleaseSource, SenderState, StartWrite
from kvpush.protocol.wire import Abort, Registration


def _registration(attempt: int) -> Registration:
    return Registration(
        request_id="r",
        attempt=attempt,
        decode_engine_id="D",
        decode_rank=0,
        decode_tp=1,
        block_ids=[3, 4],
        num_tokens=8,
        expires_at=1e12,
    )


def _abort(attempt: int) -> Abort:
    return Abort(request_id="r", attempt=attempt, decode_engine_id="D", decode_rank=0, reason="superseded")


@pytest.mark.parametrize("entry_gone", [True, False])
def test_a_late_abort_of_an_abandoned_write_is_answered_abandoned(entry_gone: bool) -> None:
    s = SenderState(0, 1, 2, 60.0, 300.0)
    s.on_prefill_done("r", (1, 2), 8, 0.0)
    (start,) = s.on_registration(_registration(0), 0.0)
    assert isinstance(start, StartWrite)
    if not entry_gone:  # a newer attempt keeps the entry alive: the old attempt's WRITE goes stale
        s.on_registration(_registration(1), 0.5)
    acts = s.on_write_done("r", 0, 0, False, 0, "timed out", 4.0, abandoned=True)
    assert any(isinstance(a, NotifyFailure) and a.abandoned for a in acts), acts
    assert any(isinstance(a, ReleaseSource) for a in acts) == entry_gone, acts
    (ack,) = [a for a in s.on_decode_abort(_abort(0), 4.0) if isinstance(a, NotifyFailure)]
    assert ack.attempt == 0 and ack.abandoned, ack
