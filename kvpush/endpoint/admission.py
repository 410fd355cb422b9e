"""What pending registrations cost the prefill, and the limits on them (per decode rank and in total).

Each connection keeps its pending registrations (`Pending`); `Admission` charges a new one its real
memory, refuses it by name over a limit, and recounts against the sender machine only when a limit is
reached, and then at most every PRUNE_EVERY_S, so a peer refused again and again at its limit cannot make
each of its registrations cost a full recount (issue 16: the push thread's round stays bounded).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from ..config import Limits
from ..protocol.wire import Registration

PRUNE_EVERY_S = 0.05  # at most this often, finished requests are recounted out of the pending limits

# What one pending registration really holds on this side (the decoded message, the sender's entry and
# ranks, the tables that index it), measured with tracemalloc (tests/endpoint/test_bounds.py): ~1,150
# bytes plus ~40 per block id (a Python int and its list slot). Charged with headroom.
REG_BYTES_FIXED = 2048
REG_BYTES_PER_BLOCK = 48


def registration_cost(msg: Registration) -> int:
    """Bytes a pending registration is charged against the per-peer memory limit."""
    return REG_BYTES_FIXED + REG_BYTES_PER_BLOCK * len(msg.block_ids) + len(msg.request_id)


class SenderView(Protocol):
    """What the prefill's connection table asks the sender machine (queries only; SenderState has them)."""

    def pending(self) -> list[str]: ...
    def writing_to(self, decode_engine_id: str, decode_rank: int) -> bool: ...


@dataclass
class Pending:
    """One connection's pending registrations: request -> bytes charged."""

    regs: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0

    def keep(self, live: set[str]) -> None:
        self.regs = {r: n for r, n in self.regs.items() if r in live}
        self.nbytes = sum(self.regs.values())


class Admission:
    """The pending-registration limits of one prefill rank."""

    def __init__(self, limits: Limits, sender: SenderView, all_pending: Callable[[], Iterable[Pending]]):
        self.limits, self.sender, self.all_pending = limits, sender, all_pending
        self.total = 0  # entries over every connection's Pending (some may have finished since)
        self._pruned_at = -PRUNE_EVERY_S

    def refusal(self, mine: Pending, msg: Registration) -> str:
        """Why a new registration is over a limit ("" if it is not); it is not recorded."""
        lim, size = self.limits, registration_cost(msg)
        if len(mine.regs) >= lim.max_pending_per_peer or mine.nbytes + size > lim.max_pending_bytes_per_peer:
            self._prune()
        if len(mine.regs) >= lim.max_pending_per_peer or mine.nbytes + size > lim.max_pending_bytes_per_peer:
            return (
                f"too many pending registrations from this decode rank ({len(mine.regs)}, "
                f"{mine.nbytes} bytes; limits {lim.max_pending_per_peer}, {lim.max_pending_bytes_per_peer})"
            )
        if self.total >= lim.max_pending_total:
            self._prune()
        if self.total >= lim.max_pending_total:
            return (
                f"too many pending registrations on this prefill rank from all decode ranks "
                f"(limits.max_pending_total {lim.max_pending_total})"
            )
        return ""

    def record(self, mine: Pending, msg: Registration) -> None:
        if msg.request_id not in mine.regs:
            size = registration_cost(msg)
            mine.regs[msg.request_id] = size
            mine.nbytes += size
            self.total += 1

    def _prune(self) -> None:
        """Forget finished requests everywhere: O(pending), so at most once per PRUNE_EVERY_S."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        live = set(self.sender.pending())
        self.total = 0
        for p in self.all_pending():
            p.keep(live)
            self.total += len(p.regs)
