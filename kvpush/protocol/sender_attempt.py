"""The current attempt of one request on the sender machine: the decode engine that made it, the decode
ranks this prefill rank owes in it (sender_table.Rank), and what went to each. SendRequest
(sender_request.py) replaces it whole when a newer attempt supersedes it or a claim is dropped, and asks it
to post ready ranges, make WRITEs ahead, tell its ranks, and settle their WRITEs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .groups import BlockIds
from .ranges import Range, StreamPolicy, pending_ranges
from .reasons import Failure
from .sender_actions import Arm, Disarm, EventOrder, NotifyDone, NotifyFailure, SenderAction, StartWrite
from .sender_table import DecodeRankState, Rank, RankEvent, Stale, Trouble, refusal
from .tp import HeadRange, owed_heads
from .wire import Registration


@dataclass(frozen=True)
class SendRules:
    """What every request of one prefill rank shares: who it is, the lease, the layers, the stream policy."""

    prefill_rank: int
    prefill_tp: int
    total_kv_heads: int
    lease_s: float
    num_layers: int
    stream: StreamPolicy

    def owed(self, decode_tp: int) -> Mapping[int, HeadRange]:
        """decode rank -> the heads this prefill rank writes into it, for a decode of `decode_tp` ranks."""
        return owed_heads(self.prefill_rank, self.prefill_tp, decode_tp, self.total_kv_heads)


class Ready(NamedTuple):
    """What may be written: the source table, tokens computed per layer, and whether prefill_done came
    (then every layer holds `num_tokens`, and nothing more will come). For a WRITE made ahead: the blocks
    and tokens source_blocks named (no frontier: the whole request is planned)."""

    blocks: BlockIds
    frontier: list[int]
    final: bool
    num_tokens: int
    order: EventOrder  # which event came first, carried on every StartWrite


class Stop(NamedTuple):
    """A registered rank that cannot be served: what it is told, and why the request ends."""

    told: str
    ending: str
    kind: Failure


@dataclass(eq=False)
class Attempt:
    """One decode engine's attempt at a request: the decode ranks owed in it and their WRITEs."""

    request_id: str
    rules: SendRules
    number: int = -1  # -1: no attempt yet (or its claim was dropped)
    engine: str = ""  # the decode engine that made it
    decode_tp: int = 0
    ranks: dict[int, Rank] = field(default_factory=dict)  # owed decode rank -> its state

    @classmethod
    def registered(cls, request_id: str, rules: SendRules, reg: Registration) -> Attempt:
        """`reg` opened a newer attempt: every decode rank this prefill rank owes in it starts owed."""
        owed = rules.owed(reg.decode_tp)
        ranks = {d: Rank(heads) for d, heads in owed.items()}
        return cls(request_id, rules, reg.attempt, reg.decode_engine_id, reg.decode_tp, ranks)

    # ---- queries ----------------------------------------------------------------------------------
    def writing(self) -> bool:
        return any(r.inflight for r in self.ranks.values())

    def all_done(self) -> bool:
        return bool(self.ranks) and all(r.state is DecodeRankState.DONE for r in self.ranks.values())

    def failure(self, d: int, reason: str, kind: Failure) -> NotifyFailure:
        return NotifyFailure(self.request_id, self.number, self.engine, d, reason, kind=kind)

    # ---- telling and fencing its ranks -------------------------------------------------------------
    def end(self, reason: str, kind: Failure) -> list[SenderAction]:
        """Nothing more is written: what was made ahead is dropped, registered ranks are told."""
        actions = self.disarm()
        for d, rank in sorted(self.ranks.items()):
            before = rank.state
            rank.move(RankEvent.END)
            if before is DecodeRankState.REGISTERED:
                actions.append(self.failure(d, reason, kind))
        return actions

    def refuse_registered(self, reason: str) -> list[SenderAction]:
        """Each registered rank is refused (its claim is being dropped)."""
        return [
            self.failure(d, reason, Failure.REFUSED)
            for d, rank in sorted(self.ranks.items())
            if rank.state is DecodeRankState.REGISTERED
        ]

    def fenced(self, trouble: Trouble | None) -> dict[tuple[int, int], Stale]:
        """Its WRITEs in flight, as a superseded attempt's: their outcome answers their decode rank."""
        out: dict[tuple[int, int], Stale] = {}
        for d, rank in self.ranks.items():
            stale = rank.stale(self.engine, trouble)
            if stale is not None:
                out[(self.number, d)] = stale
        return out

    def expire(self, now: float) -> tuple[int, NotifyFailure] | None:
        """The first registered rank whose registration expired before its WRITE could start: refused."""
        for d, rank in sorted(self.ranks.items()):
            if rank.expired(now):
                rank.move(RankEvent.REFUSE)
                why = "registration expired before prefill could write it"
                return d, self.failure(d, why, Failure.EXPIRED)
        return None

    def settled(
        self, d: int, rank: Rank, ok: bool, ending: Trouble | None, final: bool
    ) -> list[SenderAction]:
        """What a rank's settled WRITE moves it to, and the word it gets once its last one settled.
        `ending`: why the request is ending (None: open); `final`: prefill_done came."""
        if rank.inflight:
            rank.move(RankEvent.SETTLED)
            return []
        if rank.trouble is not None or (ending is not None and not (ok and rank.final_posted)):
            trouble = rank.trouble or ending
            assert trouble is not None
            rank.move(RankEvent.WRITE_FAILED)
            return [trouble.notice(self.request_id, self.number, self.engine, d)]
        if rank.final_posted:
            rank.move(RankEvent.WRITE_OK)
            return []
        if rank.complete(final):
            rank.move(RankEvent.WRITE_OK)
            return [NotifyDone(self.request_id, self.number, self.engine, d, rank.landed)]
        rank.move(RankEvent.PART_OK)
        return []

    # ---- posting ranges -----------------------------------------------------------------------------
    def post(self, ready: Ready, now: float) -> tuple[list[SenderAction], Stop | None]:
        """Post what is ready and registered: before prefill_done the ranges the policy lets go early;
        after it the rest, the last carrying the notification when no other WRITE into that rank is in
        flight (else the notification goes alone once they all landed). Stops at the first rank that
        cannot be served (the request then ends)."""
        actions: list[SenderAction] = []
        for d, rank in sorted(self.ranks.items()):
            if not rank.postable():
                continue
            reg = rank.reg
            assert reg is not None  # REGISTERED and WRITING always hold their registration
            rank.sent = rank.sent or [0] * self.rules.num_layers
            stop = _mismatch(reg, ready.num_tokens) if ready.final else None
            todo = [] if stop else self._todo(rank, reg, ready)
            if todo and now >= reg.expires_at:  # a REGISTERED rank expired already (`expire`)
                why = "registration expired before prefill could write all of it"
                stop = Stop(why, why, Failure.EXPIRED)
            if stop is not None:
                return actions + _stopped(rank, reg, stop), stop
            actions += self._post_rank(d, rank, reg, todo, ready)
        return actions, None

    def _todo(self, rank: Rank, reg: Registration, ready: Ready) -> list[Range]:
        """The ranges ready for the rank: all of them after prefill_done, the policy's early ones before."""
        todo = pending_ranges(ready.frontier, rank.sent, reg.num_tokens, rank.align)
        if not ready.final:
            top = max(ready.frontier)
            todo = [r for r in todo if self.rules.stream.early(r, top)]
        return todo

    def _post_rank(
        self, d: int, rank: Rank, reg: Registration, todo: list[Range], ready: Ready
    ) -> list[SenderAction]:
        actions: list[SenderAction] = []
        armed, rank.armed = rank.armed, None  # made ahead: posted or dropped here
        for r in todo:
            notify = ready.final and len(todo) == 1 and rank.inflight == 0
            rank.start(r, notify)
            write = self._write_for(d, rank, reg, ready, r, notify)
            if armed is not None and armed == write:
                write, armed = armed, None  # the very WRITE made ahead: the edge only posts it
            actions.append(write)
        if armed is not None:  # prefill_done named other blocks or tokens: the general path
            actions.append(Disarm(self.request_id, self.number, d))
        if ready.final and not todo and rank.inflight == 0 and rank.state is DecodeRankState.REGISTERED:
            rank.move(RankEvent.WRITE_OK)  # every range had landed before prefill_done
            actions.append(NotifyDone(self.request_id, reg.attempt, reg.decode_engine_id, d, rank.landed))
        return actions

    def _write_for(
        self, d: int, rank: Rank, reg: Registration, ready: Ready, r: Range, notify: bool
    ) -> StartWrite:
        """The StartWrite for range `r` into rank `d` (no state moves: arming builds one ahead)."""
        layers = None if (r.l0, r.l1) == (0, self.rules.num_layers) else (r.l0, r.l1)
        return StartWrite(
            self.request_id,
            reg.attempt,
            reg.decode_engine_id,
            d,
            reg.decode_tp,
            ready.blocks,
            reg.tables(),
            r.t1,
            rank.heads,
            ready.order,
            r.t0,
            layers,
            notify,
            rank.landed,
        )

    # ---- WRITEs made ahead ----------------------------------------------------------------------------
    def arm(self, source: Ready, named: str, now: float) -> list[SenderAction]:
        """Arm each registered rank that can be: the whole request in one WRITE from the named blocks, as
        prefill_done would start it (nothing streamed into it, not expired, tokens covered)."""
        out: list[SenderAction] = []
        for d, rank in sorted(self.ranks.items()):
            reg = rank.reg
            if reg is None or not rank.armable(source.num_tokens, now, named):
                continue
            rank.move(RankEvent.ARM)
            whole = Range(0, reg.num_tokens, 0, self.rules.num_layers)
            write = rank.armed = self._write_for(d, rank, reg, source, whole, True)
            out.append(Arm(write))
        return out

    def post_armed(self, num_tokens: int, now: float) -> list[SenderAction] | None:
        """prefill_done (`num_tokens`) named the blocks source_blocks did: start every armed rank with the
        StartWrite it holds, without planning ranges again. None when anything differs (a registered rank
        not armed, one expired): the general path."""
        writes: list[StartWrite] = []
        for rank in self.ranks.values():
            if rank.state is DecodeRankState.OWED:
                continue
            armed = rank.armed_write(num_tokens, now)
            if armed is None:
                return None
            writes.append(armed)
        if not writes:
            return None
        for w in writes:
            self.ranks[w.decode_rank].post_armed(w, self.rules.num_layers)
        return list(writes)

    def disarm(self) -> list[SenderAction]:
        """Every WRITE made ahead for it is dropped (the edge releases each)."""
        return [Disarm(self.request_id, self.number, d) for d, rank in self.ranks.items() if rank.disarm()]


def _mismatch(reg: Registration, num_tokens: int) -> Stop | None:
    if reg.num_tokens <= num_tokens:
        return None
    why = f"decode expects {reg.num_tokens} tokens but prefill computed {num_tokens}"
    return Stop(why, "token count mismatch", Failure.REFUSED)


def _stopped(rank: Rank, reg: Registration, stop: Stop) -> list[SenderAction]:
    """The rank cannot be served: told now if no WRITE into it is in flight, else once they settled."""
    if rank.state is DecodeRankState.REGISTERED:
        rank.move(RankEvent.REFUSE)
        return [refusal(reg, stop.told, stop.kind)]
    rank.trouble = Trouble(stop.told, stop.kind)
    return []
