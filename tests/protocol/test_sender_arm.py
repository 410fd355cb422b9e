"""The sender machine's armed WRITEs (sender_request.py, sender_attempt.py): source_blocks before prefill_done makes a registered
rank's WRITE ahead (Arm); prefill_done with the same blocks returns that very StartWrite; every other way
out returns a Disarm for it, exactly once."""

from __future__ import annotations

from kvpush.protocol.sender import (
    Arm,
    DecodeRankState,
    Disarm,
    NotifyFailure,
    ReleaseSource,
    SenderState,
    StartWrite,
)
from kvpush.protocol.wire import Abort, Registration


def reg(
    rank: int = 0, attempt: int = 0, engine: str = "D", expires_at: float = 50.0, tp: int = 1
) -> Registration:
    return Registration(
        request_id="r",
        attempt=attempt,
        decode_engine_id=engine,
        decode_rank=rank,
        decode_tp=tp,
        block_ids=[1, 2],
        num_tokens=8,
        expires_at=expires_at,
    )


def machine() -> SenderState:
    return SenderState(0, 1, 1, lease_s=10.0, tombstone_s=30.0)


def armed(s: SenderState, source_first: bool = True) -> Arm:
    if source_first:
        assert s.on_source_blocks("r", (5, 6), 8, 0.0) == []  # no registration yet: nothing to make
        acts = s.on_registration(reg(), 0.1)
    else:
        assert s.on_registration(reg(), 0.0) == []
        acts = s.on_source_blocks("r", (5, 6), 8, 0.1)
    assert [type(a) for a in acts] == [Arm], acts
    assert s.rank_states("r") == {0: DecodeRankState.REGISTERED}
    return acts[0]


def test_prefill_done_with_the_same_blocks_returns_the_armed_write_itself():
    for source_first in (True, False):
        s = machine()
        arm = armed(s, source_first)
        assert arm.write.src_blocks == (5, 6) and arm.write.notify and arm.write.order == "registration_first"
        acts = s.on_prefill_done("r", (5, 6), 8, 0.2)
        assert len(acts) == 1 and acts[0] is arm.write  # by identity: the edge only posts it
        assert s.rank_states("r") == {0: DecodeRankState.WRITING}
        done = s.on_write_done("r", 0, 0, True, 100, "", 0.3)
        assert done == [ReleaseSource("r", (5, 6), True, 100)]


def test_prefill_done_with_other_blocks_disarms_and_takes_the_general_path():
    s = machine()
    arm = armed(s)
    acts = s.on_prefill_done("r", (7, 8), 8, 0.2)
    writes = [a for a in acts if isinstance(a, StartWrite)]
    assert acts.count(Disarm("r", 0, 0)) == 1 and len(writes) == 1
    assert writes[0] is not arm.write and writes[0].src_blocks == (7, 8)
    # more tokens computed than the decode asked for: the WRITE is the same one, posted as made
    s = machine()
    arm = armed(s)
    assert s.on_prefill_done("r", (5, 6), 9, 0.2) == [arm.write]
    # fewer than the decode asked for: refused (and what was made is dropped)
    s = machine()
    armed(s)
    acts = s.on_prefill_done("r", (5,), 4, 0.2)
    assert acts.count(Disarm("r", 0, 0)) == 1 and not [a for a in acts if isinstance(a, StartWrite)]


def test_abort_expiry_new_attempt_kv_ready_and_dropped_claim_each_disarm_once():
    cases = {
        "abort": lambda s: s.abort("r", "engine gave up", 0.2),
        "decode abort": lambda s: s.on_decode_abort(
            Abort(request_id="r", attempt=0, decode_engine_id="D", decode_rank=0, reason="x"), 0.2
        ),
        "lease": lambda s: s.on_tick(10.5),
        "registration expiry": lambda s: s.on_tick(50.0),
        "new attempt": lambda s: s.on_registration(reg(attempt=1), 0.2),
        "kv_ready": lambda s: s.on_kv_ready("r", (5,), 4, None, 0.2),
        "other owner": lambda s: s.on_prefill_done("r", (5, 6), 8, 0.2, decode_engine_id="E"),
    }
    for name, event in cases.items():
        s = machine()
        arm = armed(s)
        acts = event(s)
        assert acts.count(Disarm("r", 0, 0)) == 1, (name, acts)
        assert not any(a is arm.write for a in acts), name
        later = s.on_prefill_done("r", (5, 6), 8, 0.3) + s.on_tick(100.0) + s.on_tick(200.0)
        assert Disarm("r", 0, 0) not in later and not any(a is arm.write for a in later), name
    # a new attempt's registration is armed afresh (its own key), the old one dropped first
    s = machine()
    armed(s)
    acts = s.on_registration(reg(attempt=1), 0.2)
    assert acts[0] == Disarm("r", 0, 0) and isinstance(acts[1], Arm) and acts[1].write.attempt == 1


def test_a_duplicate_registration_keeps_the_arm_and_nothing_is_armed_without_a_fit():
    s = machine()
    arm = armed(s)
    assert s.on_registration(reg(), 0.2) == []
    assert s.on_prefill_done("r", (5, 6), 8, 0.3)[0] is arm.write
    # too few tokens named, another engine named, or expired: not armed (the general path at prefill_done)
    for source, r, now in (
        (((5,), 4, ""), reg(), 0.1),
        (((5, 6), 8, "E"), reg(), 0.1),
        (((5, 6), 8, ""), reg(expires_at=0.05), 0.0),
    ):
        s = machine()
        s.on_registration(r, now)
        assert not [a for a in s.on_source_blocks("r", *source[:2], 0.1, source[2]) if isinstance(a, Arm)]


def test_source_blocks_after_prefill_done_or_finish_changes_nothing():
    s = machine()
    s.on_prefill_done("r", (5, 6), 8, 0.0)
    assert s.on_source_blocks("r", (5, 6), 8, 0.1) == []
    s = machine()
    s.abort("r", "gone", 0.0)  # a tombstone
    assert s.on_source_blocks("r", (5, 6), 8, 0.1) == [] and len(s) == 0
    # named but never finished: the lease ends it, the decode is told, prefill_done then gets its blocks back
    s = machine()
    armed(s)
    ended = s.on_tick(10.5)
    assert any(isinstance(a, NotifyFailure) for a in ended)
    rel = s.on_prefill_done("r", (5, 6), 8, 11.0) + s.on_tick(30.0) + s.on_prefill_done("r", (5, 6), 8, 31.0)
    assert [a.ok for a in rel if isinstance(a, ReleaseSource)][:1] == [False]


def test_prefill_first_counts_stay_by_the_first_real_event():
    s = machine()
    s.on_source_blocks("r", (5, 6), 8, 0.0)
    s.on_prefill_done("r", (5, 6), 8, 0.1)
    writes = [a for a in s.on_registration(reg(), 0.2) if isinstance(a, StartWrite)]
    assert writes and writes[0].order == "prefill_first"
