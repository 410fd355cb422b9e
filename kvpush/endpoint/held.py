"""Requests held out of the receiver machine while a prefill rank they need is handshaken again.

A closed connection or a silent rank is re-handshaken; until the answer says which process is there, a new
request for that rank waits here, so a restart proven by the answer does not fail it along with the old
process's requests (issue 16: the first batch after a prefill restart failed). Nothing of a held request has
been registered, so it can fail at once, and whatever ends it hands its blocks straight back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.groups import BlockIds
from ..protocol.layout import KVLayout
from ..protocol.tp import stage_senders
from .base import PrefillAddress
from .decode_conns import PrefillConnections, PrefillPeer


@dataclass(frozen=True)
class Held:
    blocks: BlockIds
    num_tokens: int
    prefill: PrefillAddress


class HeldRequests:
    def __init__(self, conns: PrefillConnections, layout: KVLayout, cap: int) -> None:
        self.conns, self.layout, self.cap = conns, layout, cap
        self._held: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def rehandshaking(self, prefill: PrefillAddress, now: float) -> PrefillPeer | None:
        """A rank of `prefill` this rank needs that had a session and is being handshaken again (its
        connection closed, or it went silent): the answer may come from a new process."""
        for rank in stage_senders(
            self.layout.tp_rank,
            self.layout.tp_size,
            prefill.tp_size,
            prefill.pp_size,
            self.layout.total_kv_heads,
        ):
            peer = self.conns.prefills.get((prefill.engine_id, rank))
            if peer is None:
                continue
            self.conns.verify_closed(peer, now)
            if peer.session is None and peer.instance:
                return peer
        return None

    def hold(self, request_id: str, held: Held) -> bool:
        """Keep it until its ranks answer; False (not held) once `cap` requests wait already."""
        if len(self._held) >= self.cap:
            return False
        self._held[request_id] = held
        return True

    def pop(self, request_id: str) -> Held:
        return self._held.pop(request_id)

    def ready(self, now: float) -> list[tuple[str, Held]]:
        """Those whose every rank has a session again, taken out (to go into the machine now)."""
        out = [(rid, h) for rid, h in self._held.items() if self.rehandshaking(h.prefill, now) is None]
        for rid, _ in out:
            del self._held[rid]
        return out

    def waiting_for(self, peer: PrefillPeer, now: float) -> list[str]:
        return [rid for rid, h in self._held.items() if self.rehandshaking(h.prefill, now) is peer]

    def ids(self) -> list[str]:
        return list(self._held)
