"""What the prefill endpoint keeps of one request, in one place per thread.

On the push thread: one `PushRequest` record per request (its prefill_done time, the engine's KV-written
barriers, whether staging copied its blocks, its timeline marks, how long an abandoned WRITE may still read
its source, the plan sides made before the trigger), keyed once by request id: forgetting a request is one
`pop`. On the engine's side: `EngineSide`, the checked table of source_blocks and whether a kv_ready went to
the push thread, dropped by the engine's own calls or, when the engine never makes them, by the push thread
as it forgets the request (kept.py counts both, so a leak shows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..protocol.groups import BlockIds
from ..protocol.prepared import Half


@dataclass(eq=False, slots=True)
class PushRequest:
    """One request on the push thread, from its first event until its SendResult (or until forgotten)."""

    marks: dict[str, float] = field(default_factory=dict)  # TIMELINE marks so far
    prefill_done_at: float | None = None
    barriers: list[Callable[[], None]] | None = None  # the engine's KV-written barriers, until called
    staged: bool = False  # the hooks staged its source blocks already
    # an abandoned WRITE may still read the source until write_linger_s after it was given up: the engine
    # gets the source blocks back only then
    reads_until: float = 0.0
    src_half: Half | None = None  # the source side of its plan, made at prefill_done before any registration
    dst_half: dict[tuple[int, int], Half] | None = None  # (attempt, decode rank) -> side made at registration

    def add_barrier(self, barrier: Callable[[], None]) -> None:
        if self.barriers is None:
            self.barriers = [barrier]
        else:
            self.barriers.append(barrier)


class EngineSide:
    """Per request, what engine calls leave for a later engine call: source_blocks' checked table
    (prefill_done naming the same ids skips the check) and the requests with a kv_ready sent to the push
    thread (not held).
    Engine threads add and take; the push thread drops a request it forgets. Single dict and set operations,
    each atomic under the GIL: no lock on the engine's path."""

    def __init__(self) -> None:
        self.sourced: dict[str, tuple[int, BlockIds]] = {}
        self.streaming: set[str] = set()

    def drop(self, request_id: str) -> None:
        self.sourced.pop(request_id, None)
        self.streaming.discard(request_id)
