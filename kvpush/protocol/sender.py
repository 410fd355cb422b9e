"""SenderState: the prefill side of the push protocol, sans-IO.

It takes events (a registration from a decode rank, prefill done, a WRITE's outcome, an abort, the clock)
and returns actions (start a WRITE, tell a decode rank we will not write, release source blocks). It
never touches a socket, a thread or NIXL: every event order is tested with a fake clock (tests/protocol).

Each decode rank this prefill rank owes KV to, within a request's current attempt, is in one named
`DecodeRankState`; `SENDER_TRANSITIONS` is the whole table of what may happen to it. An event the table does
not list raises LocalProtocolError: a bug in the caller or here, never silently absorbed.

Invariants:
- the source blocks of every prefill_done are released exactly once, and never while a WRITE from them
  may still be in flight;
- only the newest attempt of a request is ever written; a superseded attempt's blocks are never touched;
- duplicate registrations and duplicate prefill_done are idempotent;
- a request belongs to the decode engine whose registration claimed it first, or the one `prefill_done`
  names: no other engine can register for it, supersede it or abort it (claims.py);
- no WRITE is started at or after its registration's `expires_at` (the decode frees the blocks once that
  expiry plus the WRITE bound has passed); a registration that expires unserved fails the request;
- a decode rank is told about every failure of a WRITE it may be waiting for, and whether the WRITE was
  abandoned while still in flight (its bytes may still land until the decode's fence).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .claims import NO_OWNER, Tombstones, claimed_by_other, foreign
from .groups import BlockIds
from .reasons import Failure
from .sender_actions import EventOrder as EventOrder
from .sender_actions import NotifyFailure as NotifyFailure
from .sender_actions import ReleaseSource as ReleaseSource
from .sender_actions import SenderAction as SenderAction
from .sender_actions import StartWrite as StartWrite
from .table import IGNORE, Ignore, transition
from .tp import HeadRange, receivers_for, senders_for
from .wire import Abort, Registration


def _refusal(reg: Registration, reason: str, kind: Failure = Failure.REFUSED) -> NotifyFailure:
    """The answer to a registration that will not be written."""
    return NotifyFailure(
        reg.request_id, reg.attempt, reg.decode_engine_id, reg.decode_rank, reason, kind=kind
    )


class SendPhase(enum.Enum):
    OPEN = "open"  # collecting registrations / prefill done, writing
    ENDING = "ending"  # failed or aborted: waits for in-flight WRITEs, then releases


class DecodeRankState(enum.Enum):
    """Where one owed decode rank stands in the current attempt."""

    OWED = "owed"  # this prefill rank holds heads the decode rank needs; no registration yet
    REGISTERED = "registered"  # its registration is here; waiting for prefill_done
    WRITING = "writing"  # a WRITE into its blocks is in flight
    DONE = "done"  # its WRITE completed
    FAILED = "failed"  # it was told (or will be told) that we will not write


class RankEvent(enum.Enum):
    REGISTER = "register"  # a registration for this rank arrived
    START = "start"  # registration and prefill_done are both here: post the WRITE
    WRITE_OK = "write_ok"
    WRITE_FAILED = "write_failed"
    REFUSE = "refuse"  # the registration cannot be served (token count mismatch)
    END = "end"  # the request is ending (abort, lease, another rank's failure)


S, E = DecodeRankState, RankEvent
SENDER_TRANSITIONS: dict[tuple[DecodeRankState, RankEvent], DecodeRankState | Ignore] = {
    (S.OWED, E.REGISTER): S.REGISTERED,
    (S.OWED, E.END): S.FAILED,
    (S.REGISTERED, E.REGISTER): IGNORE,  # duplicate registration
    (S.REGISTERED, E.START): S.WRITING,
    (S.REGISTERED, E.REFUSE): S.FAILED,
    (S.REGISTERED, E.END): S.FAILED,
    (S.WRITING, E.REGISTER): IGNORE,
    (S.WRITING, E.WRITE_OK): S.DONE,
    (S.WRITING, E.WRITE_FAILED): S.FAILED,
    (S.WRITING, E.END): IGNORE,  # the WRITE in flight must settle before anything is freed
    (S.DONE, E.REGISTER): IGNORE,
    (S.DONE, E.END): IGNORE,
    (S.FAILED, E.REGISTER): IGNORE,
    (S.FAILED, E.END): IGNORE,
}
del S, E


def sender_transition(state: DecodeRankState, event: RankEvent) -> DecodeRankState:
    """The next state, per the table above; a pair it does not list is a LocalProtocolError."""
    return transition(SENDER_TRANSITIONS, state, event, "sender (decode rank)")


@dataclass
class _Rank:
    heads: HeadRange
    state: DecodeRankState = DecodeRankState.OWED
    reg: Registration | None = None


@dataclass
class _Entry:
    request_id: str
    deadline: float
    created_by: EventOrder
    phase: SendPhase = SendPhase.OPEN
    reason: str = ""
    kind: Failure = Failure.ABORTED
    src_blocks: BlockIds | None = None
    num_tokens: int = 0
    attempt: int = -1
    decode_engine_id: str = ""
    owner: str = NO_OWNER  # the only decode engine that may act on it (claims.py)
    decode_tp: int = 0
    ranks: dict[int, _Rank] = field(default_factory=dict)  # owed decode rank -> its state (current attempt)
    stale_in_flight: set[tuple[int, int]] = field(default_factory=set)  # (attempt, rank) of superseded WRITEs
    nbytes: int = 0

    def writing(self) -> bool:
        return bool(self.stale_in_flight) or any(
            r.state is DecodeRankState.WRITING for r in self.ranks.values()
        )


class SenderState:
    """One prefill rank's view of every request it may push."""

    def __init__(
        self,
        prefill_rank: int,
        prefill_tp: int,
        total_kv_heads: int,
        lease_s: float,
        tombstone_s: float,
        abort_tombstones_per_engine: int = 4096,
    ) -> None:
        self.rank = prefill_rank
        self.tp = prefill_tp
        self.total_kv_heads = total_kv_heads
        self.lease_s = lease_s
        self.tombstone_s = tombstone_s
        self._entries: dict[str, _Entry] = {}
        self._tombstones = Tombstones(tombstone_s, abort_tombstones_per_engine)

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def pending(self) -> list[str]:
        return list(self._entries)

    def rank_states(self, request_id: str) -> dict[int, DecodeRankState]:
        """decode rank -> state for the request's current attempt (empty if unknown); for tests and logs."""
        entry = self._entries.get(request_id)
        return {} if entry is None else {d: r.state for d, r in entry.ranks.items()}

    # ---- events -----------------------------------------------------------------------------------
    def on_registration(self, reg: Registration, now: float) -> list[SenderAction]:
        fail = self._refuse_registration(reg)
        if fail:
            return [_refusal(reg, fail)]
        # An expired registration is refused only where it would be newly accepted: a late duplicate of
        # one already accepted must not tell the decode "failed" while that rank's WRITE is in flight.
        late = "registration arrived after its expiry: not written"
        expired: list[SenderAction] = [_refusal(reg, late, Failure.EXPIRED)] if now >= reg.expires_at else []
        tomb = self._tombstones.get(reg.request_id)
        entry = self._entries.get(reg.request_id)
        owner = entry.owner if entry is not None else tomb.owner if tomb is not None else NO_OWNER
        if foreign(owner, reg.decode_engine_id):
            return [_refusal(reg, claimed_by_other(reg.request_id))]
        if entry is None and tomb is not None:
            if reg.attempt <= tomb.attempt:
                return []  # a late duplicate of something already finished
            return [_refusal(reg, "source KV already released (request finished on prefill)")]
        if entry is None:
            if expired:
                return expired
            entry = self._entries[reg.request_id] = _Entry(
                reg.request_id, now + self.lease_s, created_by="registration_first"
            )
        if entry.phase is SendPhase.OPEN:
            entry.owner = reg.decode_engine_id
        if entry.phase is SendPhase.ENDING:
            current = entry.ranks.get(reg.decode_rank) if reg.attempt == entry.attempt else None
            if current is not None and current.state in (DecodeRankState.WRITING, DecodeRankState.DONE):
                return []  # a duplicate for a rank mid-WRITE or written: the WRITE's outcome answers it
            if (reg.attempt, reg.decode_rank) in entry.stale_in_flight:
                return []
            return [_refusal(reg, entry.reason, entry.kind)]
        if reg.attempt < entry.attempt:
            return []  # superseded by a newer attempt: never written
        if reg.attempt > entry.attempt:
            if expired:
                return expired  # never supersede the current attempt with one that may not be written
            self._new_attempt(
                entry,
                reg.attempt,
                reg.decode_engine_id,
                reg.decode_tp,
                receivers_for(self.rank, self.tp, reg.decode_tp, self.total_kv_heads),
            )
            entry.deadline = now + self.lease_s
        rank = entry.ranks.get(reg.decode_rank)
        if rank is None or reg.decode_tp != entry.decode_tp:
            why = f"registration for decode rank {reg.decode_rank} (decode TP {reg.decode_tp}) "
            return [
                _refusal(reg, why + f"does not match attempt {entry.attempt}'s decode TP {entry.decode_tp}")
            ]
        if rank.state is DecodeRankState.OWED:
            if expired:
                return expired
            rank.reg = reg
        self._move(rank, RankEvent.REGISTER)
        return self._advance(entry, now)

    def on_prefill_done(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        now: float,
        decode_engine_id: str = NO_OWNER,
    ) -> list[SenderAction]:
        """The source KV is computed. `decode_engine_id`, when the prefill engine knows it (the router told
        it where the decode runs), makes that engine the owner: an earlier claim by another engine is
        refused and dropped, and another engine's abort of the id is ignored."""
        tomb = self._tombstones.get(request_id)
        if tomb is not None and request_id not in self._entries:
            if not (decode_engine_id and foreign(tomb.owner, decode_engine_id)):
                why = "request already finished or aborted on prefill"
                return [ReleaseSource(request_id, block_ids, False, 0, why, Failure.ABORTED)]
            self._tombstones.forget(request_id)  # another engine's word about a request not its own
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = _Entry(
                request_id, now + self.lease_s, created_by="prefill_first"
            )
        if entry.src_blocks is not None:
            why = "duplicate prefill_done: kept the first"
            return [ReleaseSource(request_id, block_ids, False, 0, why, Failure.REFUSED)]
        actions: list[SenderAction] = []
        if decode_engine_id and entry.phase is SendPhase.OPEN:
            if foreign(entry.owner, decode_engine_id):
                actions += self._drop_claim(entry)
            entry.owner = decode_engine_id
        entry.src_blocks, entry.num_tokens = block_ids, num_tokens
        if entry.phase is SendPhase.OPEN:
            entry.deadline = now + self.lease_s
        return actions + self._advance(entry, now)

    def on_write_done(
        self,
        request_id: str,
        attempt: int,
        decode_rank: int,
        ok: bool,
        nbytes: int,
        reason: str,
        now: float,
        abandoned: bool = False,
        kind: Failure = Failure.WRITE_FAILED,
    ) -> list[SenderAction]:
        """A WRITE settled: completed, failed (`kind` says how), or (abandoned=True) given up at its
        timeout by the edge."""
        entry = self._entries.get(request_id)
        if entry is None:
            return []
        why = f"WRITE failed: {reason}"
        told = NotifyFailure(request_id, attempt, entry.decode_engine_id, decode_rank, why, abandoned, kind)
        if (attempt, decode_rank) in entry.stale_in_flight:
            entry.stale_in_flight.discard((attempt, decode_rank))  # a superseded attempt's WRITE settled
            # if it failed, the decode's superseded attempt waits on it: say so
            return ([] if ok else [told]) + self._advance(entry, now)
        rank = entry.ranks.get(decode_rank)
        if attempt != entry.attempt or rank is None or rank.state is not DecodeRankState.WRITING:
            return []  # not a WRITE this machine started: the edge reported something twice
        actions: list[SenderAction] = []
        if ok:
            self._move(rank, RankEvent.WRITE_OK)
            entry.nbytes += nbytes
        else:
            self._move(rank, RankEvent.WRITE_FAILED)
            actions.append(told)
            actions += self._end(entry, f"WRITE to decode rank {decode_rank} failed: {reason}", kind)
        return actions + self._advance(entry, now)

    def abort(
        self, request_id: str, reason: str, now: float, kind: Failure = Failure.ABORTED
    ) -> list[SenderAction]:
        entry = self._entries.get(request_id)
        if entry is None:
            self._tombstones.prefill_aborted(request_id, now)
            return []
        return self._end(entry, reason, kind) + self._advance(entry, now)

    def on_decode_abort(self, msg: Abort, now: float) -> list[SenderAction]:
        """Decode gave up: write nothing more; each registered rank not mid-WRITE gets a failure as ack."""
        reason = f"aborted by decode rank {msg.decode_rank}: {msg.reason}"
        ack = NotifyFailure(
            msg.request_id, msg.attempt, msg.decode_engine_id, msg.decode_rank, reason, kind=Failure.ABORTED
        )
        entry = self._entries.get(msg.request_id)
        tomb = self._tombstones.get(msg.request_id)
        owner = entry.owner if entry is not None else tomb.owner if tomb is not None else NO_OWNER
        if foreign(owner, msg.decode_engine_id):
            why = f"abort refused: {claimed_by_other(msg.request_id)}"
            return [NotifyFailure(msg.request_id, msg.attempt, msg.decode_engine_id, msg.decode_rank, why)]
        if entry is None:
            if tomb is None or tomb.attempt < msg.attempt:
                self._tombstones.decode_aborted(msg.request_id, msg.attempt, msg.decode_engine_id, now)
            return [ack]
        if entry.phase is SendPhase.OPEN:
            entry.owner = msg.decode_engine_id
        if msg.attempt < entry.attempt:
            # a superseded attempt: nothing more is written into it; if no WRITE of it is in flight the
            # decode may have its blocks back now (else the WRITE's outcome answers)
            return [] if (msg.attempt, msg.decode_rank) in entry.stale_in_flight else [ack]
        if msg.attempt > entry.attempt:  # abort of an attempt whose registration has not arrived yet
            self._new_attempt(entry, msg.attempt, msg.decode_engine_id, entry.decode_tp, {})
            return [ack, *self._end(entry, reason, Failure.ABORTED), *self._advance(entry, now)]
        rank = entry.ranks.get(msg.decode_rank)
        before = rank.state if rank is not None else None
        actions = self._end(entry, reason, Failure.ABORTED) + self._advance(entry, now)
        told = any(isinstance(a, NotifyFailure) and a.decode_rank == msg.decode_rank for a in actions)
        if not told and before not in (DecodeRankState.WRITING, DecodeRankState.DONE):
            actions.insert(0, ack)  # the WRITE's own outcome answers a rank mid-WRITE or done
        return actions

    def on_tick(self, now: float) -> list[SenderAction]:
        actions: list[SenderAction] = []
        for entry in list(self._entries.values()):
            expired = self._expire_registrations(entry, now) if entry.phase is SendPhase.OPEN else []
            if expired:
                actions += expired
                continue
            if entry.phase is SendPhase.OPEN and now >= entry.deadline and not entry.writing():
                if entry.src_blocks is None:
                    why = f"lease expired: prefill of this request did not finish within {self.lease_s}s"
                else:
                    why = f"lease expired: no registration from decode within {self.lease_s}s"
                actions += self._end(entry, why, Failure.EXPIRED) + self._advance(entry, now)
            elif entry.phase is SendPhase.ENDING and entry.src_blocks is None and now >= entry.deadline:
                self._finish(entry, now)  # waited long enough for a prefill_done that never came
        self._tombstones.expire(now)
        return actions

    def writing_to(self, decode_engine_id: str, decode_rank: int) -> bool:
        """True while a WRITE towards that decode rank may be in flight (its peer must not be pruned)."""
        return any(
            e.decode_engine_id == decode_engine_id
            and (
                any(d == decode_rank for _a, d in e.stale_in_flight)
                or (decode_rank in e.ranks and e.ranks[decode_rank].state is DecodeRankState.WRITING)
            )
            for e in self._entries.values()
        )

    # ---- internals --------------------------------------------------------------------------------
    def _expire_registrations(self, entry: _Entry, now: float) -> list[SenderAction]:
        """A registration whose expiry passed before its WRITE could start can never be served."""
        for d, rank in sorted(entry.ranks.items()):
            if (
                rank.state is DecodeRankState.REGISTERED
                and rank.reg is not None
                and now >= rank.reg.expires_at
            ):
                self._move(rank, RankEvent.REFUSE)
                why = "registration expired before prefill could write it"
                return [
                    NotifyFailure(
                        entry.request_id, entry.attempt, entry.decode_engine_id, d, why, kind=Failure.EXPIRED
                    ),
                    *self._end(entry, f"decode rank {d}'s {why}", Failure.EXPIRED),
                    *self._advance(entry, now),
                ]
        return []

    @staticmethod
    def _move(rank: _Rank, event: RankEvent) -> None:
        rank.state = sender_transition(rank.state, event)

    def _new_attempt(
        self, entry: _Entry, attempt: int, engine_id: str, decode_tp: int, owed: dict[int, HeadRange]
    ) -> None:
        """A newer attempt supersedes the current one: its WRITEs in flight stay fenced, its ranks reset."""
        entry.stale_in_flight |= {
            (entry.attempt, d) for d, r in entry.ranks.items() if r.state is DecodeRankState.WRITING
        }
        entry.attempt, entry.decode_engine_id, entry.decode_tp = attempt, engine_id, decode_tp
        entry.ranks = {d: _Rank(heads) for d, heads in owed.items()}
        entry.nbytes = 0

    def _drop_claim(self, entry: _Entry) -> list[SenderAction]:
        """Another engine registered before the prefill engine named the owner: that engine is told and its
        claim forgotten (nothing of it was written: there was no source yet)."""
        told: list[SenderAction] = [
            NotifyFailure(
                entry.request_id,
                entry.attempt,
                entry.decode_engine_id,
                d,
                claimed_by_other(entry.request_id),
                kind=Failure.REFUSED,
            )
            for d, rank in sorted(entry.ranks.items())
            if rank.state is DecodeRankState.REGISTERED
        ]
        entry.attempt, entry.decode_engine_id, entry.decode_tp, entry.ranks = -1, "", 0, {}
        return told

    def _refuse_registration(self, reg: Registration) -> str:
        try:
            owners = senders_for(reg.decode_rank, reg.decode_tp, self.tp, self.total_kv_heads)
        except ValueError as exc:
            return f"registration does not fit prefill TP {self.tp}: {exc}"
        if self.rank not in owners:
            return (
                f"prefill rank {self.rank} holds no KV heads for decode rank {reg.decode_rank} "
                f"(decode TP {reg.decode_tp}, prefill TP {self.tp})"
            )
        return ""

    def _end(self, entry: _Entry, reason: str, kind: Failure) -> list[SenderAction]:
        """The request will write nothing more: registered ranks are told, owed ones just close."""
        if entry.phase is SendPhase.ENDING:
            return []
        entry.phase, entry.reason, entry.kind = SendPhase.ENDING, reason, kind
        actions: list[SenderAction] = []
        for d, rank in sorted(entry.ranks.items()):
            before = rank.state
            self._move(rank, RankEvent.END)
            if before is DecodeRankState.REGISTERED:
                actions.append(
                    NotifyFailure(
                        entry.request_id, entry.attempt, entry.decode_engine_id, d, reason, kind=kind
                    )
                )
        return actions

    def _advance(self, entry: _Entry, now: float) -> list[SenderAction]:
        """Start what can start, then release the source once nothing can still read it.

        Recurses at most once: `_expire_registrations` ends the entry (phase ENDING) before it calls back
        here, and an ENDING entry expires nothing, so the inner call cannot recurse again."""
        actions: list[SenderAction] = []
        if entry.phase is SendPhase.OPEN and entry.src_blocks is not None:
            expired = self._expire_registrations(entry, now)
            if expired:
                return expired  # it ended the entry and advanced it already
        if entry.phase is SendPhase.OPEN and entry.src_blocks is not None:
            for d, rank in sorted(entry.ranks.items()):
                if rank.state is not DecodeRankState.REGISTERED:
                    continue
                reg = rank.reg
                assert reg is not None  # REGISTERED always holds its registration
                if reg.num_tokens > entry.num_tokens:
                    self._move(rank, RankEvent.REFUSE)
                    why = f"decode expects {reg.num_tokens} tokens but prefill computed {entry.num_tokens}"
                    actions.append(_refusal(reg, why))
                    actions += self._end(entry, "token count mismatch", Failure.REFUSED)
                    break
                self._move(rank, RankEvent.START)
                actions.append(
                    StartWrite(
                        entry.request_id,
                        reg.attempt,
                        reg.decode_engine_id,
                        d,
                        reg.decode_tp,
                        entry.src_blocks,
                        reg.tables(),
                        reg.num_tokens,
                        rank.heads,
                        entry.created_by,
                    )
                )
        if entry.writing():
            return actions
        states = {r.state for r in entry.ranks.values()}
        if entry.phase is SendPhase.OPEN and entry.ranks and states == {DecodeRankState.DONE}:
            assert entry.src_blocks is not None  # DONE ranks were written from it
            actions.append(ReleaseSource(entry.request_id, entry.src_blocks, True, entry.nbytes))
            self._finish(entry, None)
        elif entry.phase is SendPhase.ENDING and entry.src_blocks is not None:
            actions.append(
                ReleaseSource(
                    entry.request_id, entry.src_blocks, False, entry.nbytes, entry.reason, entry.kind
                )
            )
            self._finish(entry, None)
        return actions

    def _finish(self, entry: _Entry, now: float | None) -> None:
        del self._entries[entry.request_id]
        expiry = (now if now is not None else entry.deadline) + self.tombstone_s
        self._tombstones.finished(entry.request_id, entry.attempt, entry.owner, expiry)
