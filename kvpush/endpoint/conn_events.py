"""What the prefill's side channel (prefill_conns.py, prefill_bindings.py) tells the push thread."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.wire import Abort, Registration


@dataclass(frozen=True)
class Admitted:
    """A registration passed identity and admission checks: the sender machine takes it."""

    registration: Registration
    at: float


@dataclass(frozen=True)
class DecodeAborted:
    abort: Abort


@dataclass(frozen=True)
class PeerDropped:
    """A decode connection is gone or replaced: the requests it registered end with `reason`."""

    request_ids: tuple[str, ...]
    reason: str


ConnEvent = Admitted | DecodeAborted | PeerDropped
