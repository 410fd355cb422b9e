"""A request belongs to one decode engine: no other bound peer can take, supersede or abort it (issue 16,
finding 2). Each scenario is the issue's: on the code before claims.py, the attacker's registration with a
higher attempt took the WRITE, its abort ended the owner's request, and its aborts of unseen ids grew the
tombstone table without bound."""

from __future__ import annotations

from kvpush.protocol.sender import DecodeRankState, NotifyFailure, ReleaseSource, SenderState, StartWrite
from kvpush.protocol.wire import Abort, Registration

OWNER, ATTACKER = "decode-A", "decode-B"


def reg(engine: str, attempt: int = 1, rid: str = "r", blocks: tuple[int, ...] = (1, 2)) -> Registration:
    return Registration(
        request_id=rid,
        attempt=attempt,
        decode_engine_id=engine,
        decode_rank=0,
        decode_tp=1,
        block_ids=list(blocks),
        num_tokens=8,
        expires_at=1e6,
    )


def abort(engine: str, attempt: int = 1, rid: str = "r") -> Abort:
    return Abort(request_id=rid, attempt=attempt, decode_engine_id=engine, decode_rank=0, reason="x")


def sender(cap: int = 4096) -> SenderState:
    return SenderState(0, 1, 2, lease_s=100.0, tombstone_s=300.0, abort_tombstones_per_engine=cap)


def writes(actions):
    return [(a.decode_engine_id, a.attempt, a.dst_blocks) for a in actions if isinstance(a, StartWrite)]


def refusals_to(actions, engine):
    return [a for a in actions if isinstance(a, NotifyFailure) and a.decode_engine_id == engine]


def test_a_higher_attempt_from_another_engine_cannot_take_a_live_request():
    s = sender()
    assert s.on_registration(reg(OWNER, 1, blocks=(1, 2)), 0.0) == []
    taken = s.on_registration(reg(ATTACKER, 2**31, blocks=(7, 8)), 0.1)
    assert [a.reason for a in refusals_to(taken, ATTACKER)] and "claimed by another" in taken[0].reason
    assert writes(s.on_prefill_done("r", (5, 6), 8, 0.2)) == [(OWNER, 1, (1, 2))]


def test_another_engine_cannot_abort_a_live_request_whatever_its_attempt():
    for attempt in (1, 7):
        s = sender()
        s.on_registration(reg(OWNER, 1), 0.0)
        out = s.on_decode_abort(abort(ATTACKER, attempt), 0.1)
        assert [a for a in out if a.decode_engine_id == OWNER] == []  # the owner hears nothing
        assert "abort refused" in refusals_to(out, ATTACKER)[0].reason
        assert s.rank_states("r") == {0: DecodeRankState.REGISTERED}
        assert writes(s.on_prefill_done("r", (5, 6), 8, 0.2)) == [(OWNER, 1, (1, 2))]


def test_the_owner_can_still_supersede_and_abort_its_own_request():
    s = sender()
    s.on_registration(reg(OWNER, 1, blocks=(1, 2)), 0.0)
    s.on_registration(reg(OWNER, 2, blocks=(3, 4)), 0.1)
    assert writes(s.on_prefill_done("r", (5, 6), 8, 0.2)) == [(OWNER, 2, (3, 4))]
    s2 = sender()
    s2.on_registration(reg(OWNER, 1), 0.0)
    out = s2.on_decode_abort(abort(OWNER, 1), 0.1)
    assert refusals_to(out, OWNER) and len(s2) == 1
    assert [a for a in s2.on_prefill_done("r", (5, 6), 8, 0.2) if isinstance(a, ReleaseSource)]


def test_a_pre_registered_id_is_handed_to_the_engine_prefill_names():
    """The attacker registers a future id first (attempt 2^31); the router told the prefill engine which decode
    the request went to, so the attacker's claim is dropped (and it is told) and the owner is written."""
    s = sender()
    s.on_registration(reg(ATTACKER, 2**31, blocks=(7, 8)), 0.0)
    out = s.on_prefill_done("r", (5, 6), 8, 0.1, decode_engine_id=OWNER)
    assert writes(out) == [] and "claimed by another" in refusals_to(out, ATTACKER)[0].reason
    assert writes(s.on_registration(reg(OWNER, 1, blocks=(1, 2)), 0.2)) == [(OWNER, 1, (1, 2))]


def test_without_a_named_owner_a_squatted_id_fails_its_owner_at_once_instead_of_hanging():
    s = sender()
    s.on_registration(reg(ATTACKER, 2**31), 0.0)
    out = s.on_registration(reg(OWNER, 1), 0.1)
    assert "claimed by another" in refusals_to(out, OWNER)[0].reason


def test_another_engines_abort_of_an_unseen_id_does_not_kill_the_request_prefill_names():
    s = sender()
    s.on_decode_abort(abort(ATTACKER, 2**31), 0.0)  # a tombstone for a future id
    out = s.on_prefill_done("r", (5, 6), 8, 0.1, decode_engine_id=OWNER)
    assert not [a for a in out if isinstance(a, ReleaseSource)]  # not released as "already aborted"
    assert writes(s.on_registration(reg(OWNER, 1, blocks=(1, 2)), 0.2)) == [(OWNER, 1, (1, 2))]


def test_the_owners_own_abort_of_an_unseen_id_still_releases_at_once():
    s = sender()
    s.on_decode_abort(abort(OWNER, 1), 0.0)
    out = s.on_prefill_done("r", (5, 6), 8, 0.1, decode_engine_id=OWNER)
    assert [a.block_ids for a in out if isinstance(a, ReleaseSource)] == [(5, 6)]


def test_aborts_of_unseen_ids_leave_a_bounded_number_of_tombstones_per_engine():
    s = sender(cap=100)
    for i in range(20_000):
        s.on_decode_abort(abort(ATTACKER, 1, rid=f"x{i}"), 0.0)
    assert s._tombstones.abort_made(ATTACKER) == 100 and len(s._tombstones) == 100
    s.on_decode_abort(abort(OWNER, 1, rid="mine"), 0.0)  # another engine's budget is its own
    assert s._tombstones.abort_made(OWNER) == 1
    out = s.on_prefill_done("x19999", (5, 6), 8, 0.1)  # the newest is still remembered
    assert [type(a) for a in out] == [ReleaseSource]
    s.on_tick(1000.0)
    assert len(s._tombstones) == 0 and s._tombstones.abort_made(ATTACKER) == 0


def test_a_finished_request_refuses_other_engines_and_ignores_the_owners_late_duplicates():
    s = sender()
    s.on_registration(reg(OWNER, 1), 0.0)
    done = s.on_prefill_done("r", (5, 6), 8, 0.1)
    assert writes(done)
    s.on_write_done("r", 1, 0, True, 100, "", 0.2)
    assert s.on_registration(reg(OWNER, 1), 0.3) == []
    assert "claimed by another" in refusals_to(s.on_registration(reg(ATTACKER, 9), 0.3), ATTACKER)[0].reason
