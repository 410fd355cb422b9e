"""How a request ends on the sender machine: aborts (by the prefill engine or a decode rank), lease and
registration expiry on the clock, closing, a claim dropped for the named owner, and a newer attempt
superseding the current one. A mixin of SenderState (sender.py), which owns the events that start and
advance a request; kept apart so every way out of a request reads in one place.
"""

from __future__ import annotations

from collections.abc import Mapping

from .claims import NO_OWNER, Tombstones, claimed_by_other, foreign
from .reasons import Failure
from .sender_actions import Forget, NotifyFailure, ReleaseSource, SenderAction
from .sender_arm import disarm
from .sender_stream import RangePosting
from .sender_table import DecodeRankState, Entry, Rank, RankEvent, SendPhase, Trouble
from .tp import HeadRange
from .wire import Abort


class RequestEnding(RangePosting):
    """Needs `lease_s`, `tombstone_s`, the entries, the tombstones and `_advance` from the machine."""

    lease_s: float
    tombstone_s: float
    _entries: dict[str, Entry]
    _tombstones: Tombstones

    def _advance(self, entry: Entry, now: float) -> list[SenderAction]:
        raise NotImplementedError

    def abort(
        self, request_id: str, reason: str, now: float, kind: Failure = Failure.ABORTED
    ) -> list[SenderAction]:
        entry = self._entries.get(request_id)
        if entry is None:
            self._tombstones.prefill_aborted(request_id, now)
            return []
        return self._end(entry, reason, kind) + self._advance(entry, now)

    def drop_streamed(self, reason: str) -> list[SenderAction]:
        """Closing: a request that streamed ranges but never heard prefill_done gives its kv_ready blocks
        back now (the transport is closed, so no WRITE reads them, and the engine can no longer call
        prefill_done, the terminal call it would otherwise wait for)."""
        out: list[SenderAction] = []
        for entry in list(self._entries.values()):
            if entry.src_blocks is None and entry.ready_blocks is not None:
                blocks, n = entry.ready_blocks, entry.nbytes
                out.append(ReleaseSource(entry.request_id, blocks, False, n, reason, Failure.CLOSED))
                self._finish(entry, None)
        return out

    def on_decode_abort(self, msg: Abort, now: float) -> list[SenderAction]:
        """Decode gave up: write nothing more; each registered rank not mid-WRITE gets a failure as ack."""
        reason = f"aborted by decode rank {msg.decode_rank}: {msg.reason}"
        entry = self._entries.get(msg.request_id)
        tomb = self._tombstones.get(msg.request_id)
        gave_up = entry.abandoned if entry is not None else tomb.abandoned if tomb is not None else ()
        ack = NotifyFailure(  # an abandoned WRITE's bytes may still land: the decode waits for the fence
            msg.request_id,
            msg.attempt,
            msg.decode_engine_id,
            msg.decode_rank,
            reason,
            (msg.attempt, msg.decode_rank) in gave_up,
            Failure.ABORTED,
        )
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
            dropped = self._new_attempt(entry, msg.attempt, msg.decode_engine_id, entry.decode_tp, {})
            return [*dropped, ack, *self._end(entry, reason, Failure.ABORTED), *self._advance(entry, now)]
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
            elif (
                entry.phase is SendPhase.ENDING
                and entry.src_blocks is None
                and now >= entry.deadline
                and not entry.writing()
            ):
                # waited long enough for a prefill_done that never came
                actions.append(Forget(entry.request_id, entry.reason, entry.ready_blocks))
                self._finish(entry, now)
        self._tombstones.expire(now)
        return actions

    def _expire_registrations(self, entry: Entry, now: float) -> list[SenderAction]:
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

    def _new_attempt(
        self, entry: Entry, attempt: int, engine_id: str, decode_tp: int, owed: Mapping[int, HeadRange]
    ) -> list[SenderAction]:
        """A newer attempt supersedes the current one: its WRITEs in flight stay fenced, its ranks reset
        (what was made ahead for them is dropped)."""
        dropped = disarm(entry)
        self._fence_in_flight(entry, None)
        entry.attempt, entry.decode_engine_id, entry.decode_tp = attempt, engine_id, decode_tp
        entry.ranks = {d: Rank(heads) for d, heads in owed.items()}
        entry.nbytes = 0
        return dropped

    def _drop_claim(self, entry: Entry) -> list[SenderAction]:
        """Another engine registered before the prefill engine named the owner: that engine is told and its
        claim forgotten (streamed ranges already in flight to it are told once they settled)."""
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
        told += disarm(entry)
        self._fence_in_flight(entry, Trouble(claimed_by_other(entry.request_id), Failure.REFUSED))
        entry.attempt, entry.decode_engine_id, entry.decode_tp, entry.ranks = -1, "", 0, {}
        return told

    def _end(self, entry: Entry, reason: str, kind: Failure) -> list[SenderAction]:
        """The request will write nothing more: registered ranks are told, owed ones just close."""
        if entry.phase is SendPhase.ENDING:
            return []
        entry.phase, entry.reason, entry.kind = SendPhase.ENDING, reason, kind
        actions = disarm(entry)
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

    def _finish(self, entry: Entry, now: float | None) -> None:
        del self._entries[entry.request_id]
        expiry = (now if now is not None else entry.deadline) + self.tombstone_s
        gave_up = frozenset(entry.abandoned)
        self._tombstones.finished(entry.request_id, entry.attempt, entry.owner, expiry, gave_up)
