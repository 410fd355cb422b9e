"""The streamed half of the sender machine: posting ready ranges into a decode rank, and what a rank is
told once its WRITEs settled. A mixin of SenderState (sender.py), which owns the events and the entries;
kept apart so the rules for ranges read in one place.
"""

from __future__ import annotations

from . import sender_table
from .groups import BlockIds
from .ranges import Range, StreamPolicy, pending_ranges
from .reasons import Failure
from .sender_actions import Disarm, NotifyDone, NotifyFailure, SenderAction, StartWrite
from .sender_table import DecodeRankState, Entry, Rank, RankEvent, Stale, Trouble, refusal
from .wire import Registration


class RangePosting:
    """Needs `num_layers`, `stream` and `_end` from the machine it is mixed into."""

    num_layers: int
    stream: StreamPolicy

    def _end(self, entry: Entry, reason: str, kind: Failure) -> list[SenderAction]:
        raise NotImplementedError

    @staticmethod
    def _move(rank: Rank, event: RankEvent) -> None:
        rank.state = sender_table.sender_transition(rank.state, event)  # one place (tests spy on it)

    @staticmethod
    def _told(request_id: str, attempt: int, engine: str, decode_rank: int, t: Trouble) -> NotifyFailure:
        return NotifyFailure(request_id, attempt, engine, decode_rank, t.reason, t.abandoned, t.kind)

    def _complete(self, entry: Entry, rank: Rank) -> bool:
        """Every byte the rank needs was posted, and prefill_done came (no range is still to come)."""
        target = rank.reg.num_tokens if rank.reg is not None else 0
        return entry.src_blocks is not None and bool(rank.sent) and all(s >= target for s in rank.sent)

    @staticmethod
    def _fence_in_flight(entry: Entry, trouble: Trouble | None) -> None:
        """The current attempt's WRITEs in flight become stale: their outcome answers their decode."""
        for d, r in entry.ranks.items():
            if r.inflight:
                stale = Stale(entry.decode_engine_id, r.inflight, r.final_posted, trouble or r.trouble)
                entry.stale_in_flight[(entry.attempt, d)] = stale

    def _post_ranges(self, entry: Entry, now: float) -> list[SenderAction]:
        """Post what is ready and registered: before prefill_done the ranges the policy lets go early;
        after it the rest, the last carrying the notification when no other WRITE into that rank is in
        flight (else the notification goes alone once they all landed)."""
        actions: list[SenderAction] = []
        final = entry.src_blocks is not None
        for d, rank in sorted(entry.ranks.items()):
            reg = rank.reg
            if rank.state not in (DecodeRankState.REGISTERED, DecodeRankState.WRITING) or rank.final_posted:
                continue
            assert reg is not None  # REGISTERED and WRITING always hold their registration
            if rank.trouble is not None:
                continue
            why = ""
            if final and reg.num_tokens > entry.num_tokens:
                why = f"decode expects {reg.num_tokens} tokens but prefill computed {entry.num_tokens}"
                ending, kind = "token count mismatch", Failure.REFUSED
            rank.sent = rank.sent or [0] * self.num_layers
            ready = [entry.num_tokens] * self.num_layers if final else (entry.ready or [])
            todo = [] if why else pending_ranges(ready, rank.sent, reg.num_tokens, rank.align)
            if not final:
                todo = [r for r in todo if self.stream.early(r, max(ready))]
            if todo and now >= reg.expires_at:  # a REGISTERED rank expired already (_expire_registrations)
                why = ending = "registration expired before prefill could write all of it"
                kind = Failure.EXPIRED
            if why:
                if rank.state is DecodeRankState.REGISTERED:
                    self._move(rank, RankEvent.REFUSE)
                    actions.append(refusal(reg, why, kind))
                else:
                    rank.trouble = Trouble(why, kind)
                return actions + self._end(entry, ending, kind)
            blocks = entry.src_blocks if entry.src_blocks is not None else entry.ready_blocks
            assert blocks is not None
            armed, rank.armed = rank.armed, None  # made ahead (sender_arm.py): posted or dropped here
            for r in todo:
                notify = final and len(todo) == 1 and rank.inflight == 0
                write = self._start(entry, d, rank, reg, blocks, r, notify)
                if armed is not None and armed == write:
                    write, armed = armed, None  # the very WRITE made ahead: the edge only posts it
                actions.append(write)
            if armed is not None:  # prefill_done named other blocks or tokens: the general path
                actions.append(Disarm(entry.request_id, entry.attempt, d))
            if final and not todo and rank.inflight == 0 and rank.state is DecodeRankState.REGISTERED:
                self._move(rank, RankEvent.WRITE_OK)  # every range had landed before prefill_done
                actions.append(
                    NotifyDone(entry.request_id, reg.attempt, reg.decode_engine_id, d, rank.landed)
                )
        return actions

    def _start(
        self,
        entry: Entry,
        d: int,
        rank: Rank,
        reg: Registration,
        blocks: BlockIds,
        r: Range,
        notify: bool,
    ) -> StartWrite:
        self._move(rank, RankEvent.START)
        rank.inflight += 1
        rank.final_posted = notify
        rank.sent[r.l0 : r.l1] = [r.t1] * (r.l1 - r.l0)
        return self._write_for(entry, d, rank, reg, blocks, r, notify)

    def _write_for(
        self,
        entry: Entry,
        d: int,
        rank: Rank,
        reg: Registration,
        blocks: BlockIds,
        r: Range,
        notify: bool,
    ) -> StartWrite:
        """The StartWrite for range `r` into rank `d` (no state moves: arming builds one ahead)."""
        layers = None if (r.l0, r.l1) == (0, self.num_layers) else (r.l0, r.l1)
        return StartWrite(
            entry.request_id,
            reg.attempt,
            reg.decode_engine_id,
            d,
            reg.decode_tp,
            blocks,
            reg.tables(),
            r.t1,
            rank.heads,
            entry.created_by,
            r.t0,
            layers,
            notify,
            rank.landed,
        )
