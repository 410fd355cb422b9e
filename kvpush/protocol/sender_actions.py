"""The sender machine's actions: what SenderState asks its edge to do (start a WRITE, tell a decode rank it
will not be written, release source blocks, make a WRITE ahead or drop one, forget a request). Plain
frozen data, so the edge and the tests read them alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .groups import BlockIds
from .reasons import Failure
from .tp import HeadRange

EventOrder = Literal["registration_first", "prefill_first"]


@dataclass(frozen=True)
class StartWrite:
    request_id: str
    attempt: int
    decode_engine_id: str
    decode_rank: int
    decode_tp: int
    src_blocks: BlockIds
    dst_blocks: BlockIds
    num_tokens: int
    heads: HeadRange
    order: EventOrder = "registration_first"  # which event arrived first (the edge counts both)
    # Streamed push: this WRITE moves tokens [token_start, num_tokens) of `layers` (None: all layers).
    # `notify`: it carries the decode rank's TransferDone, whose byte count adds `landed` (bytes of this
    # rank's earlier ranges, already landed); a WRITE of a range before the last carries nothing.
    token_start: int = 0
    layers: tuple[int, int] | None = None
    notify: bool = True
    landed: int = 0


@dataclass(frozen=True)
class NotifyFailure:
    request_id: str
    attempt: int
    decode_engine_id: str
    decode_rank: int
    reason: str
    abandoned: bool = False  # a posted WRITE was given up at its timeout: its bytes may still land
    kind: Failure = field(default=Failure.REFUSED, compare=False)


@dataclass(frozen=True)
class NotifyDone:
    """Every range of a streamed request landed, and none of their WRITEs carried the notification: tell
    the decode rank alone (TransferDone with the rank's total bytes)."""

    request_id: str
    attempt: int
    decode_engine_id: str
    decode_rank: int
    nbytes: int


@dataclass(frozen=True)
class ReleaseSource:
    request_id: str
    block_ids: BlockIds
    ok: bool
    nbytes: int
    reason: str = ""
    kind: Failure | None = field(default=None, compare=False)  # None when ok
    # ok without a WRITE: a lower prefill rank writes every head this rank holds (tp.owes_nothing)
    owed_nothing: bool = False


@dataclass(frozen=True)
class Arm:
    """The source blocks are named and the decode rank registered, before prefill_done: plan, seal and
    make `write` now, but do not post it. prefill_done with the same blocks returns this very StartWrite
    (`is`), and the edge then only posts what it made; anything else sends a Disarm first."""

    write: StartWrite


@dataclass(frozen=True)
class Disarm:
    """The WRITE made ahead for this rank will never be posted: release it (the general path, if any,
    makes its own)."""

    request_id: str
    attempt: int
    decode_rank: int


@dataclass(frozen=True)
class Forget:
    """A request that ended before prefill_done waited a lease for that terminal call in vain: the machine
    keeps nothing of it now, and neither should the edge. `ready_blocks`: what the engine reported with
    kv_ready; it still holds them and waits for a SendResult that only prefill_done brings (an engine
    bug, docs/contract.md, which the edge says by name). A later prefill_done still gets its blocks back,
    failed."""

    request_id: str
    reason: str
    ready_blocks: tuple[int, ...] | None = None


SenderAction = StartWrite | NotifyFailure | NotifyDone | ReleaseSource | Arm | Disarm | Forget
