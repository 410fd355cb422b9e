"""The sender machine's rules for one decode rank: its states, the one transition table they move through,
and the per-rank record (`Rank`) whose every state change goes through that table. sender_request.py holds
the behaviour per request (which event does what); this module holds what that behaviour may do to a rank,
so the table and the data it governs change together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .claims import foreign
from .ranges import Range
from .reasons import Failure
from .sender_actions import NotifyFailure, StartWrite
from .table import IGNORE, Ignore, transition
from .tp import HeadRange
from .wire import Registration


def refusal(reg: Registration, reason: str, kind: Failure = Failure.REFUSED) -> NotifyFailure:
    """The answer to a registration that will not be written."""
    return NotifyFailure(
        reg.request_id, reg.attempt, reg.decode_engine_id, reg.decode_rank, reason, kind=kind
    )


def late(reg: Registration) -> NotifyFailure:
    """The answer to a registration that arrived after its expiry (never to a duplicate of an accepted one:
    that rank's WRITE may be in flight)."""
    return refusal(reg, "registration arrived after its expiry: not written", Failure.EXPIRED)


class SendPhase(enum.Enum):
    OPEN = "open"  # collecting registrations, ready ranges and prefill done, writing
    ENDING = "ending"  # failed or aborted: waits for in-flight WRITEs, then releases


class DecodeRankState(enum.Enum):
    """Where one owed decode rank stands in the current attempt."""

    OWED = "owed"  # this prefill rank holds heads the decode rank needs; no registration yet
    REGISTERED = "registered"  # its registration is here, no WRITE in flight (ranges may have landed)
    WRITING = "writing"  # one or more WRITEs into its blocks are in flight
    DONE = "done"  # every byte landed and its notification went (on the last WRITE, or alone)
    FAILED = "failed"  # it was told (or will be told, once its WRITEs settled) that we will not write


class RankEvent(enum.Enum):
    REGISTER = "register"  # a registration for this rank arrived
    START = "start"  # a range (or the whole request) is ready and registered: post a WRITE
    SETTLED = "settled"  # a WRITE settled while others into the same rank are still in flight
    PART_OK = "part_ok"  # the last WRITE in flight landed, more of the request is still to come
    WRITE_OK = "write_ok"  # every byte landed and the notification went
    WRITE_FAILED = "write_failed"  # the last WRITE in flight settled and the rank is not served
    REFUSE = "refuse"  # the registration cannot be served (token count mismatch, expiry)
    END = "end"  # the request is ending (abort, lease, another rank's failure)
    ARM = "arm"  # the source blocks are named before prefill_done: its WRITE is made ahead, not posted


S, E = DecodeRankState, RankEvent
SENDER_TRANSITIONS: dict[tuple[DecodeRankState, RankEvent], DecodeRankState | Ignore] = {
    (S.OWED, E.REGISTER): S.REGISTERED,
    (S.OWED, E.END): S.FAILED,
    (S.REGISTERED, E.REGISTER): IGNORE,  # duplicate registration
    (S.REGISTERED, E.ARM): S.REGISTERED,  # made ahead (Rank.armed); prefill_done's START posts it
    (S.REGISTERED, E.START): S.WRITING,
    (S.REGISTERED, E.WRITE_OK): S.DONE,  # every range had landed: the notification goes alone
    (S.REGISTERED, E.REFUSE): S.FAILED,
    (S.REGISTERED, E.END): S.FAILED,
    (S.WRITING, E.REGISTER): IGNORE,
    (S.WRITING, E.START): IGNORE,  # another range posted beside those in flight
    (S.WRITING, E.SETTLED): IGNORE,
    (S.WRITING, E.PART_OK): S.REGISTERED,
    (S.WRITING, E.WRITE_OK): S.DONE,
    (S.WRITING, E.WRITE_FAILED): S.FAILED,
    (S.WRITING, E.END): IGNORE,  # the WRITEs in flight must settle before anything is freed
    (S.DONE, E.REGISTER): IGNORE,
    (S.DONE, E.END): IGNORE,
    (S.FAILED, E.REGISTER): IGNORE,
    (S.FAILED, E.END): IGNORE,
}
del S, E


# The same table keyed by the members' values: hashing an enum member runs Python code (Enum.__hash__),
# and every WRITE moves a rank two or three times on the push thread's path.
_BY_VALUE = {(s.value, e.value): nxt for (s, e), nxt in SENDER_TRANSITIONS.items()}


def sender_transition(state: DecodeRankState, event: RankEvent) -> DecodeRankState:
    """The next state, per the table above; a pair it does not list is a LocalProtocolError."""
    nxt = _BY_VALUE.get((state._value_, event._value_))
    if nxt is None:  # not in the table: the general lookup raises, naming the pair
        return transition(SENDER_TRANSITIONS, state, event, "sender (decode rank)")
    return state if isinstance(nxt, Ignore) else nxt


@dataclass
class Trouble:
    """Why a rank with WRITEs still in flight will not be served: told once its last WRITE settled (the
    decode may free its blocks on that word, so never while one of them may still land)."""

    reason: str
    kind: Failure
    abandoned: bool = False

    def notice(self, request_id: str, attempt: int, engine: str, decode_rank: int) -> NotifyFailure:
        """The word the decode rank gets once every WRITE into it settled."""
        return NotifyFailure(request_id, attempt, engine, decode_rank, self.reason, self.abandoned, self.kind)


def noted(old: Trouble | None, reason: str, kind: Failure, abandoned: bool) -> Trouble:
    """A failed WRITE's trouble: the first reason stays, an abandoned WRITE marks it abandoned."""
    trouble = old or Trouble(reason, kind)
    trouble.abandoned |= abandoned
    return trouble


@dataclass
class Stale:
    """A superseded attempt's WRITEs into one decode rank, still in flight."""

    engine: str  # the decode engine the superseded attempt was for
    count: int
    final: bool  # the one in flight carries its notification (it then answers the decode by itself)
    trouble: Trouble | None = None


@dataclass
class Rank:
    """One owed decode rank in the current attempt: its state (moved only through the table) and what has
    been posted into it."""

    heads: HeadRange
    state: DecodeRankState = DecodeRankState.OWED
    reg: Registration | None = None
    align: int = 1  # ranges start on a token where both sides' blocks start (ranges.py)
    sent: list[int] = field(default_factory=list)  # per layer: tokens posted (in flight or landed)
    inflight: int = 0  # WRITEs posted and not settled
    landed: int = 0  # bytes landed so far
    final_posted: bool = False  # the WRITE carrying the notification is posted
    trouble: Trouble | None = None
    armed: StartWrite | None = None  # the WRITE made ahead of prefill_done (sender_request.py), not posted

    def move(self, event: RankEvent) -> None:
        """The one place a rank changes state (tests spy on `sender_transition`)."""
        self.state = sender_transition(self.state, event)

    def expired(self, now: float) -> bool:
        """Registered, no WRITE started, and its registration's expiry passed: it can never be served."""
        return (
            self.state is DecodeRankState.REGISTERED and self.reg is not None and now >= self.reg.expires_at
        )

    def postable(self) -> bool:
        """Registered or being written, not failing, and its notification not posted yet."""
        ok = self.state is DecodeRankState.REGISTERED or self.state is DecodeRankState.WRITING
        return ok and not self.final_posted and self.trouble is None

    def armable(self, num_tokens: int, now: float, named: str) -> bool:
        """A WRITE of the whole request (`num_tokens` computed, for the engine `named` or any) may be made
        ahead for it: registered and untouched, its registration covered and not expired."""
        reg = self.reg
        if reg is None or self.state is not DecodeRankState.REGISTERED or self.armed is not None:
            return False
        if self.trouble is not None or self.inflight or any(self.sent):
            return False
        return (
            reg.num_tokens <= num_tokens and now < reg.expires_at and not foreign(named, reg.decode_engine_id)
        )

    def armed_write(self, num_tokens: int, now: float) -> StartWrite | None:
        """The WRITE made ahead, when prefill_done (`num_tokens`) may post it as it is."""
        reg = self.reg
        if self.state is not DecodeRankState.REGISTERED or reg is None:
            return None
        if now >= reg.expires_at or reg.num_tokens > num_tokens:
            return None
        return self.armed

    def post_armed(self, write: StartWrite, num_layers: int) -> None:
        self.move(RankEvent.START)
        self.armed, self.inflight, self.final_posted = None, 1, True
        self.sent = [write.num_tokens] * num_layers

    def start(self, r: Range, notify: bool) -> None:
        """A WRITE of range `r` is posted (`notify`: it carries the notification)."""
        self.move(RankEvent.START)
        self.inflight += 1
        self.final_posted = notify
        self.sent[r.l0 : r.l1] = [r.t1] * (r.l1 - r.l0)

    def settle(self, ok: bool, nbytes: int, reason: str, kind: Failure, abandoned: bool) -> None:
        """One of its WRITEs settled: the bytes landed, or the rank will not be served."""
        self.inflight -= 1
        if ok:
            self.landed += nbytes
        else:
            self.trouble = noted(self.trouble, reason, kind, abandoned)

    def complete(self, prefill_done: bool) -> bool:
        """Every byte it needs was posted, and prefill_done came (no range is still to come)."""
        target = self.reg.num_tokens if self.reg is not None else 0
        return prefill_done and bool(self.sent) and all(s >= target for s in self.sent)

    def disarm(self) -> bool:
        """Drop the WRITE made ahead, if any (True: there was one, the edge must release it)."""
        had, self.armed = self.armed is not None, None
        return had

    def stale(self, engine: str, trouble: Trouble | None) -> Stale | None:
        """Its WRITEs in flight, fenced as a superseded attempt's (None: none in flight)."""
        return (
            Stale(engine, self.inflight, self.final_posted, trouble or self.trouble)
            if self.inflight
            else None
        )
