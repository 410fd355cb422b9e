"""Sender and receiver state machines wired through a simulated network with a fake clock.

Random schedules deliver messages in any order (with duplicates), complete or fail WRITEs at random,
abort requests on either side, preempt (re-expect) requests on decode, and move the clock past leases.
Invariants checked after every step and at the end:
  - source blocks of every prefill_done are released exactly once, never while a WRITE from them is in
    flight;
  - a WRITE is only ever started for the newest attempt that decode registered;
  - every decode attempt ends in exactly one Ready or Failed; Ready only after every owed prefill rank's
    WRITE completed; Failed only once no WRITE into its blocks can still land;
  - no WRITE ever lands in blocks the decode already handed back (write-after-free), with slow WRITEs
    (longer than the WRITE timeout: the prefill abandons them, their bytes may still land within the
    linger), prefill stalls (time passes while the prefill processes nothing) and prefill_done near the
    lease end;
  - once the clock passes every deadline, nothing is left pending anywhere;
  - a WRITE made ahead (source_blocks named before prefill_done: Arm) is for the newest attempt, and is
    either posted (prefill_done's StartWrite is the armed one itself) or dropped (Disarm), exactly once.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.receiver import (
    Discarded,
    Failed,
    Ready,
    ReceiverState,
    RecvPhase,
    SendAbort,
    SendRegistration,
)
from kvpush.protocol.sender import Arm, Disarm, NotifyFailure, ReleaseSource, SenderState, StartWrite
from kvpush.protocol.wire import TransferDone, TransferFailed

LEASE, READY_TIMEOUT, TOMB = 10.0, 15.0, 30.0
WRITE_TIMEOUT, LINGER = 4.0, 1.0  # the prefill abandons a WRITE after 4 s; its bytes may land 1 s later


@dataclass
class InFlight:
    prefill_rank: int
    action: StartWrite
    posted_at: float
    lands_at: float | None  # None: never lands (fails, or abandoned and dropped)
    abandoned: bool = False


@dataclass
class World:
    p_tp: int
    d_tp: int
    heads: int
    rng: random.Random
    now: float = 0.0
    senders: list[SenderState] = field(default_factory=list)
    receivers: list[ReceiverState] = field(default_factory=list)
    net: list[tuple[str, int, object]] = field(default_factory=list)  # (to side, rank, message)
    writes: list[InFlight] = field(default_factory=list)  # posted, not settled at the prefill
    landing: list[InFlight] = field(default_factory=list)  # abandoned by the prefill, bytes may still land
    freed: dict[tuple[int, str, int], float] = field(default_factory=dict)  # decode handed blocks back
    write_after_free: int = 0
    slow: bool = False
    released: Counter[tuple[int, tuple[int, ...]]] = field(default_factory=Counter)
    given_blocks: dict[int, list[tuple[int, ...]]] = field(default_factory=lambda: defaultdict(list))
    newest_attempt: dict[str, int] = field(default_factory=dict)
    delivered_attempt: dict[tuple[int, str], int] = field(default_factory=dict)
    created: dict[tuple[int, str, int], float] = field(default_factory=dict)
    terminal: Counter[tuple[int, str, int]] = field(default_factory=Counter)
    completed_writes: set[tuple[str, int, int, int]] = field(default_factory=set)  # (req, attempt, p, d)
    next_block: int = 0
    planned: dict[str, tuple[int, ...]] = field(default_factory=dict)  # named by source_blocks
    arms: dict[tuple[int, str, int, int], StartWrite] = field(default_factory=dict)  # (p, req, attempt, d)
    armed_posts: int = 0

    def __post_init__(self) -> None:
        self.senders = [SenderState(p, self.p_tp, self.heads, LEASE, TOMB) for p in range(self.p_tp)]
        self.receivers = [
            ReceiverState("D", d, self.d_tp, self.heads, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
            for d in range(self.d_tp)
        ]

    # ---- applying actions -------------------------------------------------------------------------
    def sender_actions(self, p: int, actions: list) -> None:
        for a in actions:
            if isinstance(a, Arm):
                w = a.write
                key = (p, w.request_id, w.attempt, w.decode_rank)
                assert key not in self.arms, "armed twice"
                assert w.attempt == self.delivered_attempt.get((p, w.request_id), -1), "armed an old attempt"
                self.arms[key] = w
            elif isinstance(a, Disarm):
                key = (p, a.request_id, a.attempt, a.decode_rank)
                assert key in self.arms, "Disarm of nothing armed (or twice)"
                del self.arms[key]
            if isinstance(a, StartWrite):
                key = (p, a.request_id, a.attempt, a.decode_rank)
                if self.arms.get(key) is a:
                    del self.arms[key]
                    self.armed_posts += 1
                newest = self.delivered_attempt.get((p, a.request_id), -1)
                assert a.attempt == newest, "WRITE for an attempt older than one this rank already got"
                assert self.released[(p, a.src_blocks)] == 0, "WRITE from released blocks"
                duration = self.rng.choice([0.01, 0.5, 2.0, 6.0, 12.0] if self.slow else [0.01])
                self.writes.append(InFlight(p, a, self.now, self.now + duration))
            elif isinstance(a, NotifyFailure):
                msg = TransferFailed(
                    request_id=a.request_id,
                    attempt=a.attempt,
                    prefill_rank=p,
                    reason=a.reason,
                    abandoned=a.abandoned,
                    kind=a.kind,
                )
                self.net.append(("decode", a.decode_rank, msg))
            elif isinstance(a, ReleaseSource):
                assert not any(
                    w.prefill_rank == p and w.action.src_blocks == a.block_ids for w in self.writes
                ), "source released while a WRITE from it is in flight"
                self.released[(p, a.block_ids)] += 1
                assert self.released[(p, a.block_ids)] == 1, "source blocks released twice"

    def receiver_actions(self, d: int, actions: list) -> None:
        for a in actions:
            if isinstance(a, SendRegistration | SendAbort):
                self.net.append(("prefill", a.prefill_rank, a.message))
                if self.rng.random() < 0.2:  # duplicate delivery
                    self.net.append(("prefill", a.prefill_rank, a.message))
            elif isinstance(a, Ready | Failed):
                key = (d, a.request_id, a.attempt)
                self.terminal[key] += 1
                assert self.terminal[key] == 1, f"attempt ended twice: {key}"
                owed = self.receivers[d]
                if isinstance(a, Ready):
                    from kvpush.protocol.tp import senders_for

                    for p in senders_for(d, self.d_tp, self.p_tp, self.heads):
                        assert (a.request_id, a.attempt, p, d) in self.completed_writes, (
                            "Ready before its WRITEs"
                        )
                else:
                    self.freed[key] = self.now
                    may_land = [
                        w
                        for w in self.writes + self.landing
                        if (w.action.request_id, w.action.attempt, w.action.decode_rank)
                        == (a.request_id, a.attempt, d)
                        and (w.lands_at is not None or not w.abandoned)
                        and self.now < w.posted_at + WRITE_TIMEOUT + LINGER
                    ]
                    # a WRITE may be outstanding here only past its own bound (it can no longer land;
                    # the landing step checks that too)
                    assert not may_land, f"Failed while a WRITE may still land: {may_land} at {self.now}"
                del owed
            else:
                assert isinstance(a, Discarded)

    # ---- events -------------------------------------------------------------------------------------
    def expect(self, rid: str) -> None:
        d_blocks = tuple(range(self.next_block, self.next_block + 3))
        self.next_block += 3
        for d, r in enumerate(self.receivers):
            acts = r.expect(rid, d_blocks, 40, self.p_tp, self.now)
            for a in acts:
                if isinstance(a, SendRegistration):
                    self.newest_attempt[rid] = max(self.newest_attempt.get(rid, -1), a.message.attempt)
                    self.created[(d, rid, a.message.attempt)] = self.now
            self.receiver_actions(d, acts)

    def source_blocks(self, rid: str) -> None:
        if rid not in self.planned:
            self.planned[rid] = tuple(range(self.next_block, self.next_block + 5))
            self.next_block += 5
        for p, s in enumerate(self.senders):
            self.sender_actions(p, s.on_source_blocks(rid, self.planned[rid], 40, self.now))

    def prefill_done(self, rid: str) -> None:
        blocks = self.planned.pop(rid, None)
        if blocks is None or self.rng.random() < 0.2:  # sometimes other blocks than source_blocks named
            blocks = tuple(range(self.next_block, self.next_block + 5))
            self.next_block += 5
        for p, s in enumerate(self.senders):
            self.given_blocks[p].append(blocks)
            self.sender_actions(p, s.on_prefill_done(rid, blocks, 40, self.now))

    def deliver(self) -> None:
        if not self.net:
            return
        side, rank, msg = self.net.pop(self.rng.randrange(len(self.net)))
        if side == "prefill":
            s = self.senders[rank]
            if msg.__class__.__name__ == "Registration":
                key = (rank, msg.request_id)
                self.delivered_attempt[key] = max(self.delivered_attempt.get(key, -1), msg.attempt)
                acts = s.on_registration(msg, self.now)
            else:
                acts = s.on_decode_abort(msg, self.now)
            self.sender_actions(rank, acts)
        else:
            r = self.receivers[rank]
            acts = r.on_done(msg, self.now) if isinstance(msg, TransferDone) else r.on_failed(msg, self.now)
            self.receiver_actions(rank, acts)

    def land(self, w: InFlight) -> None:
        """The WRITE's bytes arrive in the decode's blocks (before its notification is sent)."""
        key = (w.action.decode_rank, w.action.request_id, w.action.attempt)
        if key in self.freed:
            self.write_after_free += 1
        assert key not in self.freed, f"WRITE landed in blocks the decode already freed: {key}"

    def finish_write(self, ok: bool, w: InFlight | None = None) -> None:
        """A WRITE settles at the prefill: it landed (ok) or failed (nothing landed)."""
        if w is None:
            self.progress()  # the prefill runs: it abandons overdue WRITEs before polling any
            if not self.writes:
                return
            w = self.writes.pop(self.rng.randrange(len(self.writes)))
        p = w.prefill_rank
        a = w.action
        if ok:
            self.land(w)
            self.completed_writes.add((a.request_id, a.attempt, p, a.decode_rank))
            self.net.append(
                (
                    "decode",
                    a.decode_rank,
                    TransferDone(request_id=a.request_id, attempt=a.attempt, prefill_rank=p, nbytes=100),
                )
            )
        self.sender_actions(
            p,
            self.senders[p].on_write_done(
                a.request_id,
                a.attempt,
                a.decode_rank,
                ok,
                100 if ok else 0,
                "" if ok else "injected",
                self.now,
            ),
        )

    def progress(self, prefill_running: bool = True) -> None:
        """Time-driven WRITE outcomes. kvpush's transfer thread drives its WRITEs (NIXL progress thread
        off), so a WRITE advances only while the prefill runs. The prefill checks a WRITE's timeout before
        polling it again and abandons an overdue one; bytes already in flight may land within the linger
        of the timeout; a WRITE abandoned late (the prefill was frozen past its timeout) was not progressed
        meanwhile, and nothing of it lands."""
        for w in list(self.writes):
            if not prefill_running:
                continue
            if self.now >= w.posted_at + WRITE_TIMEOUT:
                self.writes.remove(w)
                w.abandoned = True
                bound = w.posted_at + WRITE_TIMEOUT + LINGER
                on_time = self.now < bound
                late = min(bound, self.now + self.rng.random() * LINGER)
                w.lands_at = (
                    late if (on_time and w.lands_at is not None and self.rng.random() < 0.5) else None
                )
                self.landing.append(w)
                a = w.action
                self.sender_actions(
                    w.prefill_rank,
                    self.senders[w.prefill_rank].on_write_done(
                        a.request_id,
                        a.attempt,
                        a.decode_rank,
                        False,
                        0,
                        "timed out",
                        self.now,
                        abandoned=True,
                    ),
                )
            elif self.slow and w.lands_at is not None and self.now >= w.lands_at:
                self.writes.remove(w)
                self.finish_write(True, w)
        for w in list(self.landing):
            if w.lands_at is None or self.now >= w.lands_at:
                self.landing.remove(w)
                if w.lands_at is not None:
                    self.land(w)

    def tick(self, dt: float, prefill_running: bool = True) -> None:
        """Advance the clock in small steps (so time-driven WRITE outcomes happen on time); a stalled
        prefill (prefill_running=False) neither ticks nor abandons WRITEs meanwhile."""
        end = self.now + dt
        while self.now < end:
            self.now = min(end, self.now + 0.5)
            self.progress(prefill_running)
            if prefill_running:
                for p, s in enumerate(self.senders):
                    self.sender_actions(p, s.on_tick(self.now))
            for d, r in enumerate(self.receivers):
                self.receiver_actions(d, r.on_tick(self.now))


OPS = [
    "expect",
    "prefill",
    "deliver",
    "deliver",
    "deliver",
    "write_ok",
    "write_ok",
    "write_fail",
    "abort_p",
    "abort_d",
    "tick",
    "reexpect",
    "stall",
    "source",
    "source",
]


@st.composite
def setups(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    tps = [t for t in (1, 2, 4) if t <= heads or t % heads == 0]
    return heads, draw(st.sampled_from(tps)), draw(st.sampled_from(tps))


@settings(max_examples=300, deadline=None)
@given(
    setups(),
    st.integers(1, 3),
    st.lists(st.sampled_from(OPS), min_size=5, max_size=60),
    st.randoms(),
    st.booleans(),
)
def test_random_schedules_keep_every_invariant(setup, n_req, ops, rng, slow):
    heads, p_tp, d_tp = setup
    w = World(p_tp, d_tp, heads, rng, slow=slow)
    rids = [f"r{i}" for i in range(n_req)]
    expected, prefilled = set(), set()
    for op in ops:
        rid = rng.choice(rids)
        if op == "expect" and rid not in expected:
            expected.add(rid)
            w.expect(rid)
        elif op == "reexpect" and rid in expected:
            w.expect(rid)  # preempted and re-allocated: a new attempt
        elif op == "prefill" and rid not in prefilled:
            prefilled.add(rid)
            w.prefill_done(rid)
        elif op == "prefill" and rng.random() < 0.3:
            w.prefill_done(rid)  # duplicate prefill_done: its blocks must come back at once
        elif op == "source" and rid not in prefilled:
            w.source_blocks(rid)
        elif op == "deliver":
            w.deliver()
        elif op in ("write_ok", "write_fail"):
            w.finish_write(op == "write_ok")
        elif op == "abort_p":
            p = rng.randrange(p_tp)
            w.sender_actions(p, w.senders[p].abort(rid, "test abort", w.now))
        elif op == "abort_d" and rid in expected:
            d = rng.randrange(d_tp)
            w.receiver_actions(d, w.receivers[d].abort(rid, "test abort", w.now))
        elif op == "tick":
            w.tick(rng.choice([0.1, 1.0, 4.0, 9.5]))
        elif op == "stall":
            w.tick(rng.choice([1.0, 4.0, 8.0]), prefill_running=False)  # the prefill is frozen meanwhile
        for r in w.receivers:  # the count the decode's loop asks every round, against a walk
            assert r.waiting() == sum(1 for a in r._live.values() if a.phase is RecvPhase.WAITING)
    # drain: finish every WRITE, deliver every message, then let every deadline pass
    for _ in range(10_000):
        if w.writes and not slow:
            w.finish_write(rng.random() < 0.8)
        elif w.net:
            w.deliver()
        elif w.writes or w.landing:
            w.tick(0.5)
        else:
            break
    for _ in range(4):
        w.tick(READY_TIMEOUT + TOMB)
        while w.net or w.writes or w.landing:
            if w.writes and not slow:
                w.finish_write(True)
            elif w.net:
                w.deliver()
            else:
                w.tick(0.5)
    for p, s in enumerate(w.senders):
        assert len(s) == 0, f"prefill rank {p} still holds {s.pending()}"
        for blocks in w.given_blocks[p]:
            assert w.released[(p, blocks)] == 1, f"blocks {blocks} released {w.released[(p, blocks)]} times"
    for d, r in enumerate(w.receivers):
        assert len(r) == 0, f"decode rank {d} still waits"
    assert w.write_after_free == 0
    assert not w.arms, f"WRITEs made ahead never posted nor dropped: {list(w.arms)}"


def test_a_thousand_requests_with_slow_writes_and_stalls_never_write_after_free():
    """The issue's measurement: slow WRITEs (up to 12 s against a 4 s timeout), prefill stalls up to
    8 s and prefill_done near the lease end made 900-2,300 write-after-free events per 1,000 requests
    with a fixed abort grace. With registration expiry and the WRITE bound: none."""
    rng = random.Random(12)
    w = World(2, 2, 2, rng, slow=True)
    ready = failed = 0
    for i in range(1000):
        rid = f"q{i}"
        w.expect(rid)
        w.tick(rng.choice([0.0, 0.5, 3.0, LEASE - 0.5]), prefill_running=rng.random() < 0.8)
        w.prefill_done(rid)
        for _ in range(6):
            if w.net:
                w.deliver()
        if rng.random() < 0.1:
            w.receiver_actions(0, w.receivers[0].abort(rid, "client left", w.now))
        if rng.random() < 0.1:
            w.expect(rid)  # a resend with a new attempt while the old WRITE may be in flight
        w.tick(rng.choice([0.5, 2.0, 8.0]), prefill_running=rng.random() < 0.7)
        while w.net:
            w.deliver()
    w.tick(READY_TIMEOUT + WRITE_TIMEOUT + LINGER + TOMB)
    while w.net or w.writes or w.landing:
        if w.net:
            w.deliver()
        else:
            w.tick(0.5)
    w.tick(READY_TIMEOUT + TOMB)
    ready = sum(1 for (_d, _r, _a), n in w.terminal.items() if n and (_d, _r, _a) not in w.freed)
    failed = len(w.freed)
    assert w.write_after_free == 0
    assert ready > 300 and failed > 50, (ready, failed)  # the faults bite, and most requests still work
    assert all(len(r) == 0 for r in w.receivers) and all(len(s) == 0 for s in w.senders)


def test_registration_first_and_prefill_first_both_write_once():
    for reg_first in (True, False):
        s = SenderState(0, 1, 1, LEASE, TOMB)
        r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
        regs = [a for a in r.expect("x", (7, 8), 20, 1, 0.0) if isinstance(a, SendRegistration)]
        first = (
            s.on_registration(regs[0].message, 0.0) if reg_first else s.on_prefill_done("x", (1, 2), 20, 0.0)
        )
        assert not [a for a in first if isinstance(a, StartWrite)]
        second = (
            s.on_prefill_done("x", (1, 2), 20, 0.1) if reg_first else s.on_registration(regs[0].message, 0.1)
        )
        writes = [a for a in second if isinstance(a, StartWrite)]
        assert len(writes) == 1 and writes[0].dst_blocks == (7, 8) and writes[0].src_blocks == (1, 2)
        assert writes[0].order == ("registration_first" if reg_first else "prefill_first")
        done = s.on_write_done("x", 0, 0, True, 64, "", 0.2)
        assert done == [ReleaseSource("x", (1, 2), True, 64)]
        ready = r.on_done(TransferDone(request_id="x", attempt=0, prefill_rank=0, nbytes=64), 0.2)
        assert ready == [Ready("x", 0, (7, 8), 64)]


def test_superseded_attempt_is_never_written():
    s = SenderState(0, 1, 1, LEASE, TOMB)
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    old = next(a for a in r.expect("x", (1,), 10, 1, 0.0) if isinstance(a, SendRegistration))
    new_actions = r.expect("x", (2,), 10, 1, 0.1)  # preempted: new blocks, new attempt
    new = next(a for a in new_actions if isinstance(a, SendRegistration))
    assert new.message.attempt == old.message.attempt + 1
    s.on_registration(new.message, 0.2)
    assert s.on_registration(old.message, 0.3) == []  # late, stale: ignored
    writes = [a for a in s.on_prefill_done("x", (9,), 10, 0.4) if isinstance(a, StartWrite)]
    assert [(w.attempt, w.dst_blocks) for w in writes] == [(1, (2,))]


def test_lease_expiry_tells_decode_and_frees_source():
    s = SenderState(0, 1, 1, LEASE, TOMB)
    assert s.on_prefill_done("lonely", (3, 4), 10, 0.0) == []
    acts = s.on_tick(LEASE + 0.1)
    assert acts == [
        ReleaseSource(
            "lonely", (3, 4), False, 0, f"lease expired: no registration from decode within {LEASE}s"
        )
    ]
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    reg = next(a for a in r.expect("lonely", (5,), 10, 1, LEASE + 1) if isinstance(a, SendRegistration))
    late = s.on_registration(reg.message, LEASE + 1)
    assert len(late) == 1 and isinstance(late[0], NotifyFailure) and "released" in late[0].reason


def test_decode_timeout_fails_with_the_missing_ranks_named():
    r = ReceiverState("D", 0, 1, 2, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    r.expect("slow", (1,), 10, 2, 0.0)  # prefill TP2: two senders
    r.on_done(TransferDone(request_id="slow", attempt=0, prefill_rank=0, nbytes=1), 1.0)
    acts = r.on_tick(READY_TIMEOUT + 1)
    assert [a.prefill_rank for a in acts if isinstance(a, SendAbort)] == [1]
    assert not [a for a in acts if isinstance(a, Failed)]  # rank 1 may still write until the fence
    acts = r.on_tick(READY_TIMEOUT + WRITE_TIMEOUT + LINGER)
    failed = [a for a in acts if isinstance(a, Failed)]
    assert len(failed) == 1 and "[1]" in failed[0].reason


def test_an_abandoned_write_keeps_the_blocks_until_the_fence_and_a_refusal_frees_them_at_once():
    r = ReceiverState("D", 0, 1, 2, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    r.expect("x", (1,), 10, 2, 0.0)
    abandoned = TransferFailed(request_id="x", attempt=0, prefill_rank=0, reason="slow", abandoned=True)
    r.on_failed(abandoned, 1.0)
    refused = TransferFailed(request_id="x", attempt=0, prefill_rank=1, reason="aborted", abandoned=False)
    assert not [a for a in r.on_failed(refused, 1.1) if isinstance(a, Failed)]
    assert not [a for a in r.on_tick(READY_TIMEOUT + WRITE_TIMEOUT) if isinstance(a, Failed)]
    assert [type(a) for a in r.on_tick(READY_TIMEOUT + WRITE_TIMEOUT + LINGER)] == [Failed]


def test_a_gone_prefill_frees_its_requests_at_once_and_a_silent_one_at_the_fence():
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    r.expect("a", (1,), 10, 1, 0.0)
    acts = r.on_peer_silent(0, "no answer for 5s", 2.0)
    assert [type(a) for a in acts] == [SendAbort]
    assert r.owed_by(0) == 1
    acts = r.on_peer_gone(0, "a new instance answers at its address", 3.0)
    assert [type(a) for a in acts] == [Failed] and "silent" in acts[0].reason
    assert r.owed_by(0) == 0


def test_registrations_carry_their_expiry_and_the_prefill_honours_it():
    s = SenderState(0, 1, 1, LEASE, TOMB)
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    reg = next(a for a in r.expect("e", (5,), 10, 1, 0.0) if isinstance(a, SendRegistration)).message
    assert reg.expires_at == READY_TIMEOUT
    late = s.on_registration(reg, READY_TIMEOUT)
    assert len(late) == 1 and isinstance(late[0], NotifyFailure) and "expiry" in late[0].reason
    s2 = SenderState(0, 1, 1, 100.0, TOMB)
    assert s2.on_registration(reg, 1.0) == []
    acts = s2.on_tick(READY_TIMEOUT)  # never served before its expiry: refused, never written
    assert [type(a) for a in acts] == [NotifyFailure] and "expired" in acts[0].reason
    assert not [a for a in s2.on_prefill_done("e", (1,), 10, READY_TIMEOUT + 1) if isinstance(a, StartWrite)]


def test_attempt_numbers_are_bounded_in_memory_and_never_reused():
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT, WRITE_TIMEOUT + LINGER, max_remembered=8)
    seen: dict[str, set[int]] = defaultdict(set)
    for i in range(200):
        rid = f"x{i % 20}"
        reg = next(a for a in r.expect(rid, (1,), 10, 1, float(i)) if isinstance(a, SendRegistration))
        assert reg.message.attempt not in seen[rid]
        seen[rid].add(reg.message.attempt)
        r.abort(rid, "done with it", float(i))
        r.on_failed(
            TransferFailed(
                request_id=rid, attempt=reg.message.attempt, prefill_rank=0, reason="a", abandoned=False
            ),
            i,
        )
    assert len(r._next_attempt) <= 9


def test_one_sender_failing_waits_for_the_other_before_failed():
    """Decode may not hand the blocks back while another prefill rank's WRITE can still land."""
    r = ReceiverState("D", 0, 1, 2, READY_TIMEOUT, WRITE_TIMEOUT + LINGER)
    r.expect("x", (1, 2), 10, 2, 0.0)  # prefill TP2 -> two senders
    acts = r.on_failed(
        TransferFailed(request_id="x", attempt=0, prefill_rank=0, reason="boom", abandoned=False), 0.5
    )
    assert not [a for a in acts if isinstance(a, Failed)]
    assert [a.prefill_rank for a in acts if isinstance(a, SendAbort)] == [1]
    acts = r.on_done(TransferDone(request_id="x", attempt=0, prefill_rank=1, nbytes=5), 0.6)
    assert [type(a) for a in acts] == [Failed] and "boom" in acts[0].reason
