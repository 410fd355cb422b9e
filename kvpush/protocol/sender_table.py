"""The sender machine's records and rules: the per-decode-rank states, the one transition table they move
through, and the per-request record (`Entry`) the machine keeps. sender.py holds the behaviour (which
event does what); this module holds what that behaviour may do to a rank, so the table and the data it
governs change together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .claims import NO_OWNER
from .groups import BlockIds
from .reasons import Failure
from .sender_actions import EventOrder, NotifyFailure, StartWrite
from .table import IGNORE, Ignore, transition
from .tp import HeadRange
from .wire import Registration


def refusal(reg: Registration, reason: str, kind: Failure = Failure.REFUSED) -> NotifyFailure:
    """The answer to a registration that will not be written."""
    return NotifyFailure(
        reg.request_id, reg.attempt, reg.decode_engine_id, reg.decode_rank, reason, kind=kind
    )


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


@dataclass
class Rank:
    heads: HeadRange
    state: DecodeRankState = DecodeRankState.OWED
    reg: Registration | None = None
    align: int = 1  # ranges start on a token where both sides' blocks start (ranges.py)
    sent: list[int] = field(default_factory=list)  # per layer: tokens posted (in flight or landed)
    inflight: int = 0  # WRITEs posted and not settled
    landed: int = 0  # bytes landed so far
    final_posted: bool = False  # the WRITE carrying the notification is posted
    trouble: Trouble | None = None
    armed: StartWrite | None = None  # the WRITE made ahead of prefill_done (sender_arm.py), not posted


@dataclass
class Stale:
    """A superseded attempt's WRITEs into one decode rank, still in flight."""

    engine: str  # the decode engine the superseded attempt was for
    count: int
    final: bool  # the one in flight carries its notification (it then answers the decode by itself)
    trouble: Trouble | None = None


@dataclass
class Entry:
    request_id: str
    deadline: float
    created_by: EventOrder
    phase: SendPhase = SendPhase.OPEN
    reason: str = ""
    kind: Failure = Failure.ABORTED
    src_blocks: BlockIds | None = None  # prefill_done's table (the request is complete)
    num_tokens: int = 0
    ready_blocks: tuple[int, ...] | None = None  # kv_ready's table so far (a streamed request)
    ready: list[int] | None = None  # per layer: tokens computed, as kv_ready reported them
    attempt: int = -1
    decode_engine_id: str = ""
    owner: str = NO_OWNER  # the only decode engine that may act on it (claims.py)
    decode_tp: int = 0
    ranks: dict[int, Rank] = field(default_factory=dict)  # owed decode rank -> its state (current attempt)
    stale_in_flight: dict[tuple[int, int], Stale] = field(default_factory=dict)  # (attempt, rank)
    nbytes: int = 0
    abandoned: set[tuple[int, int]] = field(default_factory=set)  # (attempt, rank): a WRITE given up
    # source_blocks' word before prefill_done: (table, tokens, the decode engine it names or "")
    source: tuple[BlockIds, int, str] | None = None
    sourced: bool = False  # created by source_blocks: created_by is set by the first real event

    def writing(self) -> bool:
        return bool(self.stale_in_flight) or any(r.inflight for r in self.ranks.values())
