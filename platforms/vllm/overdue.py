"""The invariant that every request a worker holds ends within a bound it can name, checked and logged.

Each worker knows when it took a request on (decode: expect(); prefill: the hand-over of its blocks) and
the longest the protocol lets that request live (decode: its registration's fence, ready_timeout_s +
write_timeout_s + write_linger_s; prefill: lease_s + the same WRITE bound). A request still held after
that is a bug somewhere between vLLM and kvpush (a lost abort, a result never collected), never a slow
transfer: `OverdueCheck` names each such request with its state on both layers, at WARNING, at most once
per `every_s` (a stuck request must not flood the log, but must keep being visible).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("kvpush.vllm")

# how many overdue requests one log line names (the count says how many there are in all)
MAX_NAMED = 8


@dataclass(frozen=True)
class Held:
    """One request a worker holds: what the log line says about it."""

    key: str  # the transfer key
    req_id: str  # vLLM's request id
    since: float  # monotonic time the worker took it on
    state: str  # the worker's and the endpoint's view, in words


class OverdueCheck:
    """Logs held requests older than `bound_s` (rate limited); `check` returns them for the caller."""

    def __init__(self, role: str, bound_s: float, every_s: float = 30.0, check_every_s: float = 1.0) -> None:
        self.role = role
        self.bound_s = bound_s
        self.every_s = every_s
        self.check_every_s = check_every_s
        self._last_log = float("-inf")
        self._last_check = float("-inf")
        self.logged = 0  # log lines written (the tests read it)

    def due(self, now: float) -> bool:
        """Whether to look at all (the scan is cheap, but the engine thread calls this every step)."""
        if now - self._last_check < self.check_every_s:
            return False
        self._last_check = now
        return True

    def check(self, held: Iterable[Held], now: float) -> list[Held]:
        over = sorted((h for h in held if now - h.since > self.bound_s), key=lambda h: h.since)
        if over and now - self._last_log >= self.every_s:
            self._last_log = now
            self.logged += 1
            named = "; ".join(
                f"{h.key} (vLLM {h.req_id}, held {now - h.since:.1f}s: {h.state})" for h in over[:MAX_NAMED]
            )
            more = f"; and {len(over) - MAX_NAMED} more" if len(over) > MAX_NAMED else ""
            log.warning(
                "kvpush %s: %d request(s) held longer than their bound of %.1fs (a lost abort or result "
                "between vLLM and kvpush): %s%s",
                self.role,
                len(over),
                self.bound_s,
                named,
                more,
            )
        return over
