"""The prefill's data-plane table of decode ranks: each bound rank's NIXL agent, layout, session and
prepared descriptor lists (per head range), apart from the side channel that binds them (prefill_bindings.py).

`route(dest)` is the one lookup a WRITE or a notification makes: the peer and the session its notification
is sealed for, or `PeerGone`; the notifications that go alone (done, failed) are sent from here. A peer the
side channel no longer binds stays while the sender machine still writes to it; `prune` then drops it and
releases its prepared lists (and the NIXL peer once no connection uses its agent). Lists of a peer replaced
by a new agent are released the same way, once nothing writes to that rank any more: a queued or made WRITE
may still index them until then. Teardown releases them all (`close`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from ..errors import LayoutError, PeerGone, TransportError
from ..protocol.handshake import Session
from ..protocol.layout import KVLayout
from ..protocol.order import done_notice, failure_notice
from ..protocol.prepared import PairUnits, pair_units
from ..protocol.reasons import Failure
from ..protocol.sender import NotifyDone, NotifyFailure
from ..protocol.tp import owed_heads
from ..transport.base import PreparedList, Transport, listed_descriptors
from .stats import Count, Ledger

log = logging.getLogger("kvpush")

Identity = tuple[str, int]  # (decode engine id, decode rank)


@dataclass
class Prepared:
    """A pair's prepared lists: made once at handshake, indexed by every request to that decode rank."""

    units: PairUnits
    local: PreparedList
    remote: PreparedList


@dataclass
class DecodePeer:
    """A bound decode rank's NIXL agent, layout, live session (None once its connection is gone) and
    prepared lists per head range (None: that range posts fresh descriptor lists)."""

    agent: str
    layout: KVLayout
    session: Session | None
    prepared: dict[tuple[int, int], Prepared | None] = field(default_factory=dict)


class DecodePeers:
    """The decode ranks this prefill rank may WRITE to, by (engine, rank)."""

    def __init__(self, layout: KVLayout, mem_type: str, transport: Transport, ledger: Ledger) -> None:
        self.layout, self.mem_type, self.transport, self.ledger = layout, mem_type, transport, ledger
        self._peers: dict[Identity, DecodePeer] = {}
        self._retired: list[tuple[Identity, DecodePeer]] = []  # replaced: released once nothing writes there

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, identity: Identity) -> DecodePeer | None:
        return self._peers.get(identity)

    def values(self) -> list[DecodePeer]:
        return list(self._peers.values())

    def route(self, dest: Identity) -> tuple[DecodePeer, Session]:
        """The peer a WRITE or notification for `dest` goes to, and its live session; PeerGone if none."""
        peer = self._peers.get(dest)
        if peer is None:
            raise PeerGone(f"no handshake with decode {dest[0]!r} rank {dest[1]}")
        if peer.session is None:
            raise PeerGone(f"no live session with decode {dest[0]!r} rank {dest[1]}")
        return peer, peer.session

    def bind(self, identity: Identity, agent: str, layout: KVLayout, session: Session) -> None:
        """The side channel proved `identity` on a connection: route to its agent, sealing for `session`.
        The same agent and layout keep their prepared lists (a reconnect); the pair's lists are prepared
        here, at handshake, so the first request only computes indices."""
        old = self._peers.get(identity)
        if old is not None and old.agent == agent and old.layout == layout:
            old.session = session
            return
        if old is not None:
            self._retired.append((identity, old))
        peer = self._peers[identity] = DecodePeer(agent, layout, session)
        lay = self.layout
        owed = owed_heads(lay.tp_rank, lay.tp_size, layout.tp_size, lay.total_kv_heads).get(layout.tp_rank)
        if owed is not None:
            self.prepared(peer, owed)

    def unbind(self, identity: Identity) -> None:
        """Its connection is gone: no new notification can be sealed for it (prune drops it later)."""
        peer = self._peers.get(identity)
        if peer is not None:
            peer.session = None

    def notify_done(self, act: NotifyDone) -> None:
        """Every range landed and no WRITE carried the notification: it goes alone."""
        try:
            peer, session = self.route((act.decode_engine_id, act.decode_rank))
            notice = done_notice(act.request_id, act.attempt, self.layout.rank, act.nbytes, session)
            self.transport.send_notif(peer.agent, notice)
        except TransportError as exc:  # the decode's fence or liveness check ends its wait
            log.warning("kvpush prefill: could not tell decode that %s landed: %s", act.request_id, exc)

    def notify_failure(self, act: NotifyFailure) -> None:
        """Tell a decode rank it will not be written (or that a WRITE was given up)."""
        dest = (act.decode_engine_id, act.decode_rank)
        if dest not in self._peers:
            log.warning(
                "kvpush prefill: cannot tell decode %s rank %s that %s failed: %s (no handshake)",
                act.decode_engine_id,
                act.decode_rank,
                act.request_id,
                act.reason,
            )
            return
        if act.kind is Failure.EXPIRED:
            self.ledger.add(Count.EXPIRED)
        try:
            peer, session = self.route(dest)
            self.transport.send_notif(peer.agent, failure_notice(act, self.layout.rank, session))
        except TransportError as exc:
            log.warning("kvpush prefill: %s", exc)

    def prepared(self, peer: DecodePeer, heads: tuple[int, int]) -> Prepared | None:
        """Prepare (once) the local and remote descriptor lists of this pair; None: this pair posts
        fresh descriptor lists (build_plan) instead, e.g. when its units overflow NIXL's int32 indices."""
        if heads in peer.prepared:
            return peer.prepared[heads]
        prepared: Prepared | None = None
        try:
            units = pair_units(self.layout, peer.layout, heads)
            local = self.transport.prepare(None, units.s.rows, self.mem_type)
            try:
                remote = self.transport.prepare(peer.agent, units.d.rows, self.mem_type)
            except TransportError:
                self._release(local)
                raise
            prepared = Prepared(units, local, remote)
            strided = self.transport.strided_lists
            self.ledger.add(Count.PREPARED_LISTS, 2)
            self.ledger.add(
                Count.PREPARED_DESCRIPTORS,
                listed_descriptors(units.s.rows, strided) + listed_descriptors(units.d.rows, strided),
            )
        except (LayoutError, TransportError) as exc:
            log.warning(
                "kvpush prefill: no prepared lists for %s (%s); posting descriptor lists", peer.agent, exc
            )
        peer.prepared[heads] = prepared
        return prepared

    def prune(
        self, bound: Container[Identity], writing_to: Callable[[str, int], bool], agents_in_use: set[str]
    ) -> None:
        """Drop every peer neither bound nor written to, releasing its prepared lists (and its NIXL peer
        unless a connection still uses that agent); a replaced peer's lists once nothing writes there."""
        for identity, peer in list(self._peers.items()):
            if identity not in bound and not writing_to(*identity):
                del self._peers[identity]
                self._drop(peer, agents_in_use)
        if self._retired:
            live = agents_in_use | {p.agent for p in self._peers.values()}
            retired, self._retired = self._retired, []
            for identity, peer in retired:
                if writing_to(*identity):  # a WRITE queued or made for the old agent may index them
                    self._retired.append((identity, peer))
                else:
                    self._drop(peer, live)

    def close(self) -> None:
        """Teardown, after every WRITE was settled or released: release every prepared list."""
        for peer in [*self._peers.values(), *(p for _i, p in self._retired)]:
            self._release_lists(peer)
        self._peers.clear()
        self._retired.clear()

    def _drop(self, peer: DecodePeer, agents_in_use: set[str]) -> None:
        self._release_lists(peer)
        if peer.agent not in agents_in_use:
            with contextlib.suppress(TransportError):
                self.transport.remove_peer(peer.agent)

    def _release_lists(self, peer: DecodePeer) -> None:
        lists = [p for p in peer.prepared.values() if p is not None]
        peer.prepared.clear()
        for p in lists:
            self._release(p.local)
            self._release(p.remote)

    def _release(self, plist: PreparedList) -> None:
        try:
            self.transport.release_prepared(plist)
        except TransportError as exc:
            log.warning("kvpush prefill: could not release a prepared descriptor list: %s", exc)
