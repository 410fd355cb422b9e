"""ReceiverState: one decode rank's side of the push protocol, sans-IO.

`expect` reserves nothing itself (the engine already allocated the blocks); it returns the registrations
to send, one per prefill rank that owes this rank KV. Notifications are counted per expected sender; the
request is Ready only when every one has arrived. Every attempt ends in exactly one of Ready or Failed, and
a Failed attempt is reported only once no WRITE into its blocks can still land, so the engine may reuse
the blocks at that moment.

Fencing. Each registration carries an expiry (`expires_at`, the attempt's ready deadline; the endpoint
rewrites it into the prefill's clock, conservatively). A prefill never posts a WRITE at or after it, and
abandons a WRITE `write_timeout_s` after posting it; `write_linger_s` bounds how long an abandoned WRITE's
bytes may still arrive. So at `fence_at = expires_at + write_timeout_s + write_linger_s` no WRITE of the
attempt can land, whatever the prefill did or did not say. Before that, a prefill rank settles only by
news that rules a WRITE out: its TransferDone, a TransferFailed for a rank with no WRITE in flight, or
proof that the prefill process is gone (`on_peer_gone`). A TransferFailed that says a WRITE was abandoned
settles the rank only at the fence. There is no fixed grace constant anywhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .groups import BlockIds, flat_ids
from .reasons import Failure, received
from .table import IGNORE, Ignore, transition
from .tp import stage_senders
from .wire import Abort, Registration, TransferDone, TransferFailed


@dataclass(frozen=True)
class SendRegistration:
    prefill_rank: int
    message: Registration


@dataclass(frozen=True)
class SendAbort:
    prefill_rank: int
    message: Abort
    repeat: bool = False  # a resend (the rank has not answered the first): failing to send it settles nothing


@dataclass(frozen=True)
class Ready:
    request_id: str
    attempt: int
    block_ids: BlockIds
    nbytes: int


@dataclass(frozen=True)
class Failed:
    request_id: str
    attempt: int
    block_ids: BlockIds
    reason: str
    kind: Failure = field(default=Failure.REMOTE, compare=False)


@dataclass(frozen=True)
class Discarded:
    """A message that matched nothing live (late, stale or unknown): dropped, with the reason."""

    reason: str


ReceiverAction = SendRegistration | SendAbort | Ready | Failed | Discarded


class RecvPhase(enum.Enum):
    WAITING = "waiting"
    ENDING = "ending"  # failing/aborting/superseded: waits for senders to settle, then Failed


class PrefillRankState(enum.Enum):
    """Where one prefill rank that owes this attempt KV stands."""

    EXPECTED = "expected"  # its WRITE (and notification) may still come
    ABANDONED = "abandoned"  # it gave up on a posted WRITE: the bytes may land until the fence
    DONE = "done"  # its notification arrived: its bytes landed
    FAILED = "failed"  # it told us it will not write and has no WRITE in flight (or its WRITE failed)
    GAVE_UP = "gave_up"  # the fence passed, or the prefill is proven gone: no WRITE of it can land


class RecvEvent(enum.Enum):
    DONE = "done"  # TransferDone from this rank
    FAILED = "failed"  # TransferFailed (or a refusal) from this rank, no WRITE in flight
    ABANDON = "abandon"  # TransferFailed saying a posted WRITE was abandoned at its timeout
    FENCE = "fence"  # the attempt's fence passed: no WRITE of it can land any more
    GONE = "gone"  # the prefill process is proven gone (restarted, or it closed its side channel)


R, V = PrefillRankState, RecvEvent
RECEIVER_TRANSITIONS: dict[tuple[PrefillRankState, RecvEvent], PrefillRankState | Ignore] = {
    (R.EXPECTED, V.DONE): R.DONE,
    (R.EXPECTED, V.FAILED): R.FAILED,
    (R.EXPECTED, V.ABANDON): R.ABANDONED,
    (R.EXPECTED, V.FENCE): R.GAVE_UP,
    (R.EXPECTED, V.GONE): R.GAVE_UP,
    (R.ABANDONED, V.DONE): IGNORE,  # the abandoned WRITE landed after all; the attempt still fails
    (R.ABANDONED, V.FAILED): IGNORE,
    (R.ABANDONED, V.ABANDON): IGNORE,
    (R.ABANDONED, V.FENCE): R.GAVE_UP,
    (R.ABANDONED, V.GONE): R.GAVE_UP,
    (R.DONE, V.DONE): IGNORE,  # duplicate notification (discarded)
    (R.DONE, V.FAILED): IGNORE,  # its bytes landed; the attempt still ends with the failure
    (R.DONE, V.ABANDON): IGNORE,
    (R.DONE, V.FENCE): IGNORE,
    (R.DONE, V.GONE): IGNORE,
    (R.FAILED, V.DONE): IGNORE,  # late done after a failure: discarded, the attempt already ends
    (R.FAILED, V.FAILED): IGNORE,
    (R.FAILED, V.ABANDON): IGNORE,
    (R.FAILED, V.FENCE): IGNORE,
    (R.FAILED, V.GONE): IGNORE,
    (R.GAVE_UP, V.DONE): IGNORE,
    (R.GAVE_UP, V.FAILED): IGNORE,
    (R.GAVE_UP, V.ABANDON): IGNORE,
    (R.GAVE_UP, V.FENCE): IGNORE,
    (R.GAVE_UP, V.GONE): IGNORE,
}
del R, V


def receiver_transition(state: PrefillRankState, event: RecvEvent) -> PrefillRankState:
    """The next state, per the table above; a pair it does not list is a LocalProtocolError."""
    return transition(RECEIVER_TRANSITIONS, state, event, "receiver (prefill rank)")


@dataclass
class _Attempt:
    request_id: str
    attempt: int
    block_ids: BlockIds
    deadline: float  # ready deadline, and the registrations' expiry
    fence_at: float  # no WRITE of this attempt can land from here on
    senders: dict[int, PrefillRankState]  # owed prefill rank -> its state
    phase: RecvPhase = RecvPhase.WAITING
    reason: str = ""
    kind: Failure = Failure.REMOTE
    nbytes: int = 0
    # gone prefill rank -> when bytes it sent before it died have surely landed (see on_peer_gone)
    lingering: dict[int, float] = field(default_factory=dict)
    abort_sent_at: float = 0.0  # when the ranks were last told the attempt ended (see abort_resend_s)

    def unsettled(self) -> list[int]:
        return sorted(
            p
            for p, st in self.senders.items()
            if st in (PrefillRankState.EXPECTED, PrefillRankState.ABANDONED)
        )

    def move(self, rank: int, event: RecvEvent) -> PrefillRankState:
        """Apply event to rank; returns the state before."""
        before = self.senders[rank]
        self.senders[rank] = receiver_transition(before, event)
        return before


class ReceiverState:
    def __init__(
        self,
        engine_id: str,
        decode_rank: int,
        decode_tp: int,
        total_kv_heads: int,
        ready_timeout_s: float,
        write_bound_s: float,
        max_remembered: int = 1 << 16,
        gone_linger_s: float = 0.0,
        abort_resend_s: float = 0.0,
    ) -> None:
        """write_bound_s: the prefill's WRITE timeout plus the linger of an abandoned WRITE (config).
        gone_linger_s: how long after a prefill rank is proven gone bytes it had sent may still land (the
        config's write_linger_s). abort_resend_s: an ending attempt tells a rank that has not answered
        again this often (0: never), so a lost Abort or a lost answer to it costs one interval, not the
        wait until the fence."""
        self.engine_id = engine_id
        self.rank = decode_rank
        self.tp = decode_tp
        self.total_kv_heads = total_kv_heads
        self.ready_timeout_s = ready_timeout_s
        self.write_bound_s = write_bound_s
        self.max_remembered = max_remembered
        self.gone_linger_s = gone_linger_s
        self.abort_resend_s = abort_resend_s
        self._live: dict[tuple[str, int], _Attempt] = {}
        self._current: dict[str, int] = {}  # request -> newest attempt
        self._waiting = 0  # live attempts in RecvPhase.WAITING (waiting())
        # request -> next attempt number, for requests no longer live: bounded, oldest forgotten first
        # (a forgotten request restarts at a random-free but larger base: see _new_attempt_number)
        self._next_attempt: dict[str, int] = {}
        self._epoch = 0  # bumps each time the memory is trimmed: keeps new attempt numbers above old ones

    def __len__(self) -> int:
        return len(self._live)

    def tracks(self, request_id: str) -> bool:
        """True while any attempt of request_id is still live (waiting or settling)."""
        return any(rid == request_id for rid, _attempt in self._live)

    def describe(self, request_id: str, now: float) -> str:
        """The current attempt's phase, each owed prefill rank's state and the time to its fence, in words
        (for a log line; single lookups and a copy of a small dict, so another thread may call it)."""
        attempt = self._current.get(request_id)
        att = self._live.get((request_id, attempt)) if attempt is not None else None
        if att is None:
            return "the endpoint no longer tracks it"
        ranks = ", ".join(f"prefill rank {r} {s.value}" for r, s in sorted(dict(att.senders).items()))
        why = f" ({att.reason})" if att.reason else ""
        return f"attempt {att.attempt} {att.phase.value}{why}; {ranks}; fence in {att.fence_at - now:.1f}s"

    def waiting(self) -> int:
        """Live attempts still WAITING: asked every loop round (the decode is busy while any is), so
        counted as they change, not by a walk over every live attempt."""
        return self._waiting

    def expect(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        prefill_tp: int,
        now: float,
        prefill_pp: int = 1,
    ) -> list[ReceiverAction]:
        """Blocks are allocated for request_id (one table, or one per KV-cache group); register them with
        the prefill ranks that owe them: with prefill_pp stages, every stage's ranks (numbered globally,
        stage x prefill_tp + TP rank), so the attempt is Ready only once every stage's layers landed."""
        # A live earlier attempt is superseded; its Abort goes out after the new registration, so each
        # prefill rank sees the newer attempt first and takes the abort as one of a superseded attempt.
        # Sent first, it ended the whole request there and the new registration was refused (issue 21:
        # a second expect() for one id failed both attempts).
        superseded: list[ReceiverAction] = []
        prev = self._current.get(request_id)
        if prev is not None and (request_id, prev) in self._live:
            superseded = self._end(
                self._live[(request_id, prev)], "superseded by a newer attempt", now, Failure.SUPERSEDED
            )
        attempt = self._new_attempt_number(request_id)
        self._current[request_id] = attempt
        senders = stage_senders(self.rank, self.tp, prefill_tp, prefill_pp, self.total_kv_heads)
        deadline = now + self.ready_timeout_s
        att = _Attempt(
            request_id,
            attempt,
            block_ids,
            deadline,
            deadline + self.write_bound_s,
            dict.fromkeys(senders, PrefillRankState.EXPECTED),
        )
        self._live[(request_id, attempt)] = att
        self._waiting += 1
        ids, sizes = flat_ids(block_ids)
        reg = Registration(
            request_id=request_id,
            attempt=attempt,
            decode_engine_id=self.engine_id,
            decode_rank=self.rank,
            decode_tp=self.tp,
            block_ids=list(ids),
            num_tokens=num_tokens,
            expires_at=deadline,  # in this side's clock; the endpoint converts it for each prefill
            group_sizes=list(sizes),
        )
        registrations: list[ReceiverAction] = [SendRegistration(p, reg) for p in sorted(senders)]
        return registrations + superseded + self._settle(att)

    def on_done(self, msg: TransferDone, now: float) -> list[ReceiverAction]:
        att = self._live.get((msg.request_id, msg.attempt))
        if att is None:
            return [Discarded(f"done for unknown request {msg.request_id!r} attempt {msg.attempt}")]
        if msg.prefill_rank not in att.senders:
            return [
                Discarded(f"done from prefill rank {msg.prefill_rank}, which owes {msg.request_id!r} nothing")
            ]
        if att.move(msg.prefill_rank, RecvEvent.DONE) is not PrefillRankState.EXPECTED:
            return [Discarded(f"duplicate done from prefill rank {msg.prefill_rank} for {msg.request_id!r}")]
        att.nbytes += msg.nbytes
        return self._settle(att)

    def on_failed(self, msg: TransferFailed, now: float, kind: Failure | None = None) -> list[ReceiverAction]:
        """A prefill rank will not write (kind: how the edge knows; by default, a prefill's notification:
        the kind it names, as `reasons.received` reads it)."""
        att = self._live.get((msg.request_id, msg.attempt))
        if att is None or msg.prefill_rank not in att.senders:
            return [
                Discarded(
                    f"failure for unknown request {msg.request_id!r} attempt {msg.attempt}: {msg.reason}"
                )
            ]
        att.move(msg.prefill_rank, RecvEvent.ABANDON if msg.abandoned else RecvEvent.FAILED)
        if kind is None:
            kind = received(msg.kind, msg.abandoned)
        actions = self._end(att, f"prefill rank {msg.prefill_rank}: {msg.reason}", now, kind)
        return actions + self._settle(att)

    def on_peer_gone(self, prefill_rank: int, reason: str, now: float) -> list[ReceiverAction]:
        """The prefill rank's process is proven gone (a new instance answers at its address, or it closed its
        side channel): none of its WRITEs can land any more; every attempt it owed fails now."""
        actions: list[ReceiverAction] = []
        for att in list(self._live.values()):
            if prefill_rank in att.unsettled():
                actions += self._end(
                    att, f"prefill rank {prefill_rank} is gone: {reason}", now, Failure.PEER_GONE
                )
                if self.gone_linger_s > 0:
                    # A dead process posts nothing more, but bytes it sent before may still be landing: over
                    # TCP, UCX emulates a PUT and our own progress writes them (found by kvpush soak). The
                    # blocks come back once they surely have, gone_linger_s from now.
                    if att.senders[prefill_rank] is PrefillRankState.EXPECTED:
                        att.move(prefill_rank, RecvEvent.ABANDON)
                    until = att.lingering.get(prefill_rank, now + self.gone_linger_s)
                    att.lingering[prefill_rank] = min(until, now + self.gone_linger_s)
                    continue
                att.move(prefill_rank, RecvEvent.GONE)
                actions += self._settle(att)
        return [a for a in actions if not (isinstance(a, SendAbort) and a.prefill_rank == prefill_rank)]

    def on_peer_silent(self, prefill_rank: int, reason: str, now: float) -> list[ReceiverAction]:
        """The prefill rank stopped answering (maybe frozen, maybe dead): its attempts end now, and their
        blocks come back once the fence proves no WRITE can land (or the rank turns out to be gone)."""
        actions: list[ReceiverAction] = []
        for att in list(self._live.values()):
            if prefill_rank in att.unsettled():
                why = f"prefill rank {prefill_rank} is silent: {reason}"
                actions += self._end(att, why, now, Failure.PEER_SILENT)
        return actions

    def owed_by(self, prefill_rank: int) -> int:
        """Live attempts still waiting on this prefill rank (for liveness checks)."""
        return sum(1 for a in self._live.values() if prefill_rank in a.unsettled())

    def abort(self, request_id: str, reason: str, now: float) -> list[ReceiverAction]:
        attempt = self._current.get(request_id)
        att = self._live.get((request_id, attempt)) if attempt is not None else None
        if att is None:
            return [Discarded(f"abort of unknown request {request_id!r}")]
        return self._end(att, reason, now, Failure.ABORTED) + self._settle(att)

    def cancel(
        self, request_id: str, prefill_tp: int, reason: str, now: float, prefill_pp: int = 1
    ) -> list[ReceiverAction]:
        """Abort whether or not expect() ran. A request dropped before its blocks were allocated still
        tells the prefill ranks that would have owed it, so prefill frees its blocks now, not at lease
        expiry."""
        if self.tracks(request_id):
            return self.abort(request_id, reason, now)
        msg = Abort(
            request_id=request_id,
            attempt=self._peek_attempt_number(request_id),
            decode_engine_id=self.engine_id,
            decode_rank=self.rank,
            reason=reason,
        )
        return [
            SendAbort(p, msg)
            for p in sorted(stage_senders(self.rank, self.tp, prefill_tp, prefill_pp, self.total_kv_heads))
        ]

    def on_tick(self, now: float) -> list[ReceiverAction]:
        actions: list[ReceiverAction] = []
        for att in list(self._live.values()):
            for rank, until in list(att.lingering.items()):
                if now >= until:  # a gone rank's last bytes have landed
                    del att.lingering[rank]
                    att.move(rank, RecvEvent.GONE)
                    actions += self._settle(att)
            if (att.request_id, att.attempt) in self._live:
                actions += self._resend_abort(att, now)
            if now < att.deadline or (att.request_id, att.attempt) not in self._live:
                continue
            if att.phase is RecvPhase.WAITING:
                missing = att.unsettled()
                actions += self._end(
                    att,
                    f"timed out after {self.ready_timeout_s}s waiting for KV from prefill ranks {missing}",
                    now,
                    Failure.TIMEOUT,
                )
            if now >= att.fence_at:
                # past the registrations' expiry plus the WRITE bound: no sender can still write
                for rank in list(att.senders):
                    att.move(rank, RecvEvent.FENCE)
                actions += self._settle(att)
        return actions

    # ---- attempt numbers ----------------------------------------------------------------------------
    def _peek_attempt_number(self, request_id: str) -> int:
        return max(self._next_attempt.get(request_id, 0), self._epoch)

    def _new_attempt_number(self, request_id: str) -> int:
        """Attempt numbers only grow per request. The memory of them is bounded: past max_remembered the
        oldest half is forgotten, and every number handed out afterwards starts above any handed out
        before (`_epoch`), so a forgotten request can never reuse an old attempt number."""
        attempt = self._peek_attempt_number(request_id)
        self._next_attempt.pop(request_id, None)
        self._next_attempt[request_id] = attempt + 1
        if len(self._next_attempt) > self.max_remembered:
            self._epoch = max(self._epoch, *self._next_attempt.values())
            for rid in list(self._next_attempt)[: len(self._next_attempt) // 2]:
                if rid not in self._current:
                    del self._next_attempt[rid]
        return attempt

    def close(self, reason: str) -> list[ReceiverAction]:
        """The endpoint is going away and its memory is deregistered, so no WRITE can land any more:
        every live attempt fails now, each exactly once."""
        out: list[ReceiverAction] = [
            Failed(
                a.request_id,
                a.attempt,
                a.block_ids,
                a.reason or reason,
                a.kind if a.reason else Failure.CLOSED,
            )
            for a in self._live.values()
        ]
        self._live.clear()
        self._current.clear()
        self._waiting = 0
        return out

    def _end(self, att: _Attempt, reason: str, now: float, kind: Failure) -> list[ReceiverAction]:
        if att.phase is RecvPhase.ENDING:
            return []
        self._waiting -= 1
        att.phase, att.reason, att.kind = RecvPhase.ENDING, reason, kind
        att.abort_sent_at = now
        return [SendAbort(p, self._abort_message(att)) for p in att.unsettled()]

    def _abort_message(self, att: _Attempt) -> Abort:
        return Abort(
            request_id=att.request_id,
            attempt=att.attempt,
            decode_engine_id=self.engine_id,
            decode_rank=self.rank,
            reason=att.reason,
        )

    def _resend_abort(self, att: _Attempt, now: float) -> list[ReceiverAction]:
        """An ending attempt whose ranks have not answered tells them again. The prefill answers every Abort
        (a rank mid-WRITE by the WRITE's outcome), and its answer says no WRITE of the attempt can still
        land, so a repeat is safe; it only bounds a lost message to one interval instead of the fence.
        Ranks that gave up on a WRITE (abandoned, or lingering after death) wait for the fence whatever
        the prefill says, so they are not asked."""
        if att.phase is not RecvPhase.ENDING or self.abort_resend_s <= 0:
            return []
        if now - att.abort_sent_at < self.abort_resend_s:
            return []
        ranks = [
            p
            for p, st in sorted(att.senders.items())
            if st is PrefillRankState.EXPECTED and p not in att.lingering
        ]
        if not ranks:
            return []
        att.abort_sent_at = now
        msg = self._abort_message(att)
        return [SendAbort(p, msg, repeat=True) for p in ranks]

    def _settle(self, att: _Attempt) -> list[ReceiverAction]:
        if att.unsettled():
            return []
        del self._live[(att.request_id, att.attempt)]
        if self._current.get(att.request_id) == att.attempt:
            del self._current[att.request_id]
        if att.phase is RecvPhase.WAITING:
            self._waiting -= 1
            return [Ready(att.request_id, att.attempt, att.block_ids, att.nbytes)]
        return [Failed(att.request_id, att.attempt, att.block_ids, att.reason, att.kind)]
