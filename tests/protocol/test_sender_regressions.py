"""Sender bugs found by the random-schedule simulation, pinned as plain tests (CI has no hypothesis DB)."""

from __future__ import annotations

from kvpush.protocol.sender import DecodeRankState, NotifyFailure, SenderState, StartWrite
from kvpush.protocol.wire import Registration


def reg(rank: int, expires_at: float, attempt: int = 0) -> Registration:
    return Registration(
        request_id="r",
        attempt=attempt,
        decode_engine_id="D",
        decode_rank=rank,
        decode_tp=2,
        block_ids=[1, 2],
        num_tokens=8,
        expires_at=expires_at,
    )


def test_a_late_duplicate_registration_never_fails_a_rank_whose_write_is_in_flight():
    s = SenderState(0, 1, 2, lease_s=10.0, tombstone_s=30.0)  # one prefill rank owes two decode ranks
    assert s.on_registration(reg(0, expires_at=15.0), 0.0) == []
    writes = s.on_prefill_done("r", (5, 6), 8, 14.0)
    assert [w.decode_rank for w in writes if isinstance(w, StartWrite)] == [0]
    # rank 0's registration is delivered again after its expiry, while its WRITE is in flight
    late = s.on_registration(reg(0, expires_at=15.0), 15.0)
    assert not [a for a in late if isinstance(a, NotifyFailure)], late
    assert s.rank_states("r")[0] is DecodeRankState.WRITING
    # a registration that would be newly accepted after its expiry is still refused
    refused = s.on_registration(reg(1, expires_at=15.0), 15.0)
    assert [type(a) for a in refused] == [NotifyFailure] and "expiry" in refused[0].reason
    assert s.rank_states("r")[1] is DecodeRankState.OWED


def test_an_expired_registration_of_a_newer_attempt_does_not_supersede_the_current_one():
    s = SenderState(0, 1, 2, lease_s=10.0, tombstone_s=30.0)
    s.on_registration(reg(0, expires_at=15.0), 0.0)
    s.on_prefill_done("r", (5, 6), 8, 1.0)
    refused = s.on_registration(reg(0, expires_at=2.0, attempt=1), 3.0)
    assert [type(a) for a in refused] == [NotifyFailure]
    assert s.rank_states("r")[0] is DecodeRankState.WRITING  # attempt 0's WRITE still counts
