"""The sender machine's records and rules: the per-decode-rank states, the one transition table they move
through, and the per-request record (`Entry`) the machine keeps. sender.py holds the behaviour (which
event does what); this module holds what that behaviour may do to a rank, so the table and the data it
governs change together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .claims import NO_OWNER
from .reasons import Failure
from .sender_actions import EventOrder, NotifyFailure
from .table import IGNORE, Ignore, transition
from .tp import HeadRange
from .wire import Registration


def refusal(reg: Registration, reason: str, kind: Failure = Failure.REFUSED) -> NotifyFailure:
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
class Rank:
    heads: HeadRange
    state: DecodeRankState = DecodeRankState.OWED
    reg: Registration | None = None


@dataclass
class Entry:
    request_id: str
    deadline: float
    created_by: EventOrder
    phase: SendPhase = SendPhase.OPEN
    reason: str = ""
    kind: Failure = Failure.ABORTED
    src_blocks: tuple[int, ...] | None = None
    num_tokens: int = 0
    attempt: int = -1
    decode_engine_id: str = ""
    owner: str = NO_OWNER  # the only decode engine that may act on it (claims.py)
    decode_tp: int = 0
    ranks: dict[int, Rank] = field(default_factory=dict)  # owed decode rank -> its state (current attempt)
    stale_in_flight: set[tuple[int, int]] = field(default_factory=set)  # (attempt, rank) of superseded WRITEs
    nbytes: int = 0

    def writing(self) -> bool:
        return bool(self.stale_in_flight) or any(
            r.state is DecodeRankState.WRITING for r in self.ranks.values()
        )
