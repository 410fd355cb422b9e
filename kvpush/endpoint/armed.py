"""WRITEs made ahead of prefill_done (the sender machine's `Arm`, protocol/sender_attempt.py): planned, sealed
and made on the push thread while the engine still computes, kept here unposted. prefill_done's StartWrite
takes one by identity and the scheduler only posts it; a `Disarm`, the request's release or closing
releases it. Each handle leaves this store exactly once: taken (the scheduler then owns it) or released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..protocol.handshake import Session
from ..protocol.plan import TransferPlan
from ..protocol.prepared import IndexPlan
from ..protocol.sender import StartWrite
from ..transport.base import Transport
from .posting import MadeWrite, discard

log = logging.getLogger("kvpush")

Key = tuple[str, int, int]  # (request id, attempt, decode rank)


@dataclass(frozen=True, eq=False)
class ArmedWrite:
    act: StartWrite  # the machine's StartWrite, returned again (the same object) by prefill_done
    plan: TransferPlan | IndexPlan
    spec: MadeWrite
    session: Session  # the session its notification was sealed for: a new one means a new peer
    seq: int  # notifications sealed on that session before this one (the decode's replay window)
    at: float  # when it was made (monotonic)


class ArmedStore:
    """Made, unposted WRITEs by request, then (attempt, decode rank); the push thread's alone (an engine
    call reads it only under the thread's round lock: loop.run_inline)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        # request id -> (attempt, decode rank) -> its WRITE: a request's own entries without a scan
        self._made: dict[str, dict[tuple[int, int], ArmedWrite]] = {}

    def __len__(self) -> int:
        return sum(len(ranks) for ranks in self._made.values())

    def __bool__(self) -> bool:
        return bool(self._made)  # one read on every WRITE's path, where __len__ would sum

    def __contains__(self, key: Key) -> bool:
        return key[1:] in self._made.get(key[0], {})

    def bytes_for(self, request_id: str) -> int:
        """The bytes of the WRITEs made ahead for request_id (0: none)."""
        return sum(w.plan.nbytes for w in self._made.get(request_id, {}).values())

    def put(self, key: Key, w: ArmedWrite) -> None:
        self.drop(key)  # the machine arms a rank once; a second one replaces (and releases) the first
        self._made.setdefault(key[0], {})[key[1:]] = w

    def take(self, act: StartWrite) -> ArmedWrite | None:
        """The WRITE made for exactly this StartWrite (the machine returned the armed one), else None:
        a StartWrite built anew goes the general path and leaves the store to its Disarm."""
        ranks = self._made.get(act.request_id)
        w = None if ranks is None else ranks.get((act.attempt, act.decode_rank))
        if w is None or w.act is not act:
            return None
        self._remove(act.request_id, (act.attempt, act.decode_rank))
        return w

    def drop(self, key: Key) -> None:
        w = self._remove(key[0], key[1:])
        if w is not None:
            discard(self.transport, w.spec)

    def drop_request(self, request_id: str) -> None:
        """The request is finished: anything still made for it is released (a Disarm normally came)."""
        for w in self._made.pop(request_id, {}).values():
            discard(self.transport, w.spec)

    def close(self) -> None:
        """Before the transport closes: release every handle still made."""
        for request_id in list(self._made):
            self.drop_request(request_id)

    def _remove(self, request_id: str, rank_key: tuple[int, int]) -> ArmedWrite | None:
        ranks = self._made.get(request_id)
        if ranks is None:
            return None
        w = ranks.pop(rank_key, None)
        if not ranks:
            del self._made[request_id]
        return w
