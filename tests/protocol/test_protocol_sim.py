"""Sender and receiver state machines wired through a simulated network with a fake clock.

Random schedules deliver messages in any order (with duplicates), complete or fail WRITEs at random,
abort requests on either side, preempt (re-expect) requests on decode, and move the clock past leases.
Invariants checked after every step and at the end:
  - source blocks of every prefill_done are released exactly once, never while a WRITE from them is in
    flight;
  - a WRITE is only ever started for the newest attempt that decode registered;
  - every decode attempt ends in exactly one Ready or Failed; Ready only after every owed prefill rank's
    WRITE completed; Failed only once no WRITE into its blocks can still land (or its deadline passed);
  - once the clock passes every deadline, nothing is left pending anywhere.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.receiver import Discarded, Failed, Ready, ReceiverState, SendAbort, SendRegistration
from kvpush.protocol.sender import NotifyFailure, ReleaseSource, SenderState, StartWrite
from kvpush.protocol.wire import TransferDone, TransferFailed

LEASE, READY_TIMEOUT, TOMB = 10.0, 15.0, 30.0


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
    writes: list[tuple[int, StartWrite]] = field(default_factory=list)  # in flight: (prefill rank, action)
    released: Counter[tuple[int, tuple[int, ...]]] = field(default_factory=Counter)
    given_blocks: dict[int, list[tuple[int, ...]]] = field(default_factory=lambda: defaultdict(list))
    newest_attempt: dict[str, int] = field(default_factory=dict)
    delivered_attempt: dict[tuple[int, str], int] = field(default_factory=dict)
    created: dict[tuple[int, str, int], float] = field(default_factory=dict)
    terminal: Counter[tuple[int, str, int]] = field(default_factory=Counter)
    completed_writes: set[tuple[str, int, int, int]] = field(default_factory=set)  # (req, attempt, p, d)
    next_block: int = 0

    def __post_init__(self) -> None:
        self.senders = [SenderState(p, self.p_tp, self.heads, LEASE, TOMB) for p in range(self.p_tp)]
        self.receivers = [
            ReceiverState("D", d, self.d_tp, self.heads, READY_TIMEOUT, abort_grace_s=3.0)
            for d in range(self.d_tp)
        ]

    # ---- applying actions -------------------------------------------------------------------------
    def sender_actions(self, p: int, actions: list) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                newest = self.delivered_attempt.get((p, a.request_id), -1)
                assert a.attempt == newest, "WRITE for an attempt older than one this rank already got"
                assert self.released[(p, a.src_blocks)] == 0, "WRITE from released blocks"
                self.writes.append((p, a))
            elif isinstance(a, NotifyFailure):
                msg = TransferFailed(
                    request_id=a.request_id, attempt=a.attempt, prefill_rank=p, reason=a.reason
                )
                self.net.append(("decode", a.decode_rank, msg))
            elif isinstance(a, ReleaseSource):
                assert not any(q == p and w.src_blocks == a.block_ids for q, w in self.writes), (
                    "source released while a WRITE from it is in flight"
                )
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
                    in_flight = [
                        w
                        for _p, w in self.writes
                        if w.request_id == a.request_id and w.attempt == a.attempt and w.decode_rank == d
                    ]
                    # the receiver may stop waiting for a stuck WRITE only after its bounded grace
                    assert not in_flight or self.now >= self.created[key] + 3.0, (
                        "Failed while a WRITE may still land"
                    )
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

    def prefill_done(self, rid: str) -> None:
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

    def finish_write(self, ok: bool) -> None:
        if not self.writes:
            return
        p, w = self.writes.pop(self.rng.randrange(len(self.writes)))
        if ok:
            self.completed_writes.add((w.request_id, w.attempt, p, w.decode_rank))
            self.net.append(
                (
                    "decode",
                    w.decode_rank,
                    TransferDone(request_id=w.request_id, attempt=w.attempt, prefill_rank=p, nbytes=100),
                )
            )
        self.sender_actions(
            p,
            self.senders[p].on_write_done(
                w.request_id,
                w.attempt,
                w.decode_rank,
                ok,
                100 if ok else 0,
                "" if ok else "injected",
                self.now,
            ),
        )

    def tick(self, dt: float) -> None:
        self.now += dt
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
]


@st.composite
def setups(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    tps = [t for t in (1, 2, 4) if t <= heads or t % heads == 0]
    return heads, draw(st.sampled_from(tps)), draw(st.sampled_from(tps))


@settings(max_examples=300, deadline=None)
@given(setups(), st.integers(1, 3), st.lists(st.sampled_from(OPS), min_size=5, max_size=60), st.randoms())
def test_random_schedules_keep_every_invariant(setup, n_req, ops, rng):
    heads, p_tp, d_tp = setup
    w = World(p_tp, d_tp, heads, rng)
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
            w.tick(rng.choice([0.1, 1.0, 4.0]))
    # drain: finish every WRITE, deliver every message, then let every deadline pass
    for _ in range(10_000):
        if w.writes:
            w.finish_write(rng.random() < 0.8)
        elif w.net:
            w.deliver()
        else:
            break
    for _ in range(4):
        w.tick(READY_TIMEOUT + TOMB)
        while w.net or w.writes:
            if w.writes:
                w.finish_write(True)
            else:
                w.deliver()
    for p, s in enumerate(w.senders):
        assert len(s) == 0, f"prefill rank {p} still holds {s.pending()}"
        for blocks in w.given_blocks[p]:
            assert w.released[(p, blocks)] == 1, f"blocks {blocks} released {w.released[(p, blocks)]} times"
    for d, r in enumerate(w.receivers):
        assert len(r) == 0, f"decode rank {d} still waits"


def test_registration_first_and_prefill_first_both_write_once():
    for reg_first in (True, False):
        s = SenderState(0, 1, 1, LEASE, TOMB)
        r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT)
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
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT)
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
    r = ReceiverState("D", 0, 1, 1, READY_TIMEOUT)
    reg = next(a for a in r.expect("lonely", (5,), 10, 1, LEASE + 1) if isinstance(a, SendRegistration))
    late = s.on_registration(reg.message, LEASE + 1)
    assert len(late) == 1 and isinstance(late[0], NotifyFailure) and "released" in late[0].reason


def test_decode_timeout_fails_with_the_missing_ranks_named():
    r = ReceiverState("D", 0, 1, 2, READY_TIMEOUT)
    r.expect("slow", (1,), 10, 2, 0.0)  # prefill TP2: two senders
    r.on_done(TransferDone(request_id="slow", attempt=0, prefill_rank=0, nbytes=1), 1.0)
    acts = r.on_tick(READY_TIMEOUT + 1)
    failed = [a for a in acts if isinstance(a, Failed)]
    assert len(failed) == 1 and "[1]" in failed[0].reason
    assert [a.prefill_rank for a in acts if isinstance(a, SendAbort)] == [1]


def test_one_sender_failing_waits_for_the_other_before_failed():
    """Decode may not hand the blocks back while another prefill rank's WRITE can still land."""
    r = ReceiverState("D", 0, 1, 2, READY_TIMEOUT)
    r.expect("x", (1, 2), 10, 2, 0.0)  # prefill TP2 -> two senders
    acts = r.on_failed(TransferFailed(request_id="x", attempt=0, prefill_rank=0, reason="boom"), 0.5)
    assert not [a for a in acts if isinstance(a, Failed)]
    assert [a.prefill_rank for a in acts if isinstance(a, SendAbort)] == [1]
    acts = r.on_done(TransferDone(request_id="x", attempt=0, prefill_rank=1, nbytes=5), 0.6)
    assert [type(a) for a in acts] == [Failed] and "boom" in acts[0].reason
