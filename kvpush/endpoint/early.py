"""kv_ready calls the push thread need not hear yet, held on the engine's side.

Below `stream_min_tokens` no range may move before prefill_done (StreamPolicy.early: the most tokens any
layer has ready must reach the threshold), and with staging hooks a request moves in one piece anyway. Such
a call only records state, so the endpoint keeps it here instead of waking the push thread, and the push
thread replays what is held, in order, before the request's next command (a kv_ready that may move
something, prefill_done or abort): a 256-token request streamed layer by layer then costs one wake-up,
not sixteen. The push thread takes over whatever is still held when it closes (so those requests are
failed and their blocks handed back, as if it had heard every call) and whatever was first held more than
half a lease ago (so a request the engine never finishes meets the lease in the sender machine, as it would
have without the hold).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import EndpointClosed
from ..protocol.groups import Table


@dataclass(frozen=True)
class ReadyCall:
    """One kv_ready call's arguments, checked (PrefillEndpoint.kv_ready)."""

    block_ids: Table
    num_tokens: int
    layers: tuple[int, int] | None
    kv_written: Callable[[], None] | None
    decode_engine_id: str


class HeldCalls:
    """Per request, the kv_ready calls held so far and when the first was held. Engine threads add and the
    push thread takes; one lock, skipped while nothing is held (a dict's emptiness is one read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[float, list[ReadyCall]]] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held  # one dict read: safe from any thread

    def hold(self, request_id: str, call: ReadyCall, now: float) -> None:
        """Keep `call`; EndpointClosed once the push thread has taken everything over for good."""
        with self._lock:
            if self._closed:
                raise EndpointClosed(f"kvpush endpoint is closed: kv_ready {request_id!r} not taken")
            got = self._held.get(request_id)
            if got is None:
                self._held[request_id] = (now, [call])
            else:
                got[1].append(call)

    def take(self, request_id: str) -> list[ReadyCall]:
        """(push thread) The calls held for request_id, in order, now no longer held."""
        if not self._held:
            return []
        with self._lock:
            got = self._held.pop(request_id, None)
        return [] if got is None else got[1]

    def overdue(self, before: float) -> dict[str, list[ReadyCall]]:
        """(push thread) Take every request first held before `before`."""
        if not self._held:
            return {}
        with self._lock:
            old = [rid for rid, (at, _) in self._held.items() if at < before]
            return {rid: self._held.pop(rid)[1] for rid in old}

    def close(self) -> dict[str, list[ReadyCall]]:
        """(push thread, teardown) Take everything; later holds raise EndpointClosed."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, {}
        return {rid: calls for rid, (_, calls) in held.items()}
