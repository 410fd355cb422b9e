"""What the prefill ranks say to the decode, and what their silence means: NIXL notifications, side-channel
replies (Hello answers, refusals, Posted, pings) and liveness (pings, silence, proof of death, pruning).

What may end a request here: a sealed message (or, without a key, any message from the local host), proof
that the prefill process is gone, or this side's own clocks (silence past peer_timeout_s, our own stall).
An unauthenticated frame on a keyed connection never does: decode_conns.py turns it into a `Hint`, which
at most starts a fresh handshake. Nothing a rank does or fails to do here ends another rank's connection or
the thread: a connection that cannot be made again fails the requests of that rank, by name.
"""

from __future__ import annotations

import logging

from ..config_groups import Limits, Liveness
from ..errors import LayoutError, WireError
from ..protocol.handshake import check_peer_hello
from ..protocol.layout import KVLayout
from ..protocol.reasons import Failure
from ..protocol.tp import check_peer_tp
from ..protocol.wire import (
    ErrorCode,
    ErrorReply,
    Hello,
    Message,
    Ping,
    Pong,
    Posted,
    TransferDone,
    TransferFailed,
)
from .decode_conns import CHANNEL_ERRORS, Hint, PrefillConnections, PrefillPeer
from .decode_requests import DecodeRequests
from .stats import Count, Ledger

log = logging.getLogger("kvpush")


class PrefillReplies:
    """Turns what prefill ranks send (and do not send) into the requests' events."""

    def __init__(
        self,
        layout: KVLayout,
        limits: Limits,
        liveness: Liveness,
        write_timeout_s: float,
        conns: PrefillConnections,
        requests: DecodeRequests,
        ledger: Ledger,
    ) -> None:
        self.layout, self.limits, self.timeouts = layout, limits, liveness
        self.write_timeout_s = write_timeout_s
        self.conns, self.requests, self.ledger = conns, requests, ledger

    # ---- NIXL notifications -------------------------------------------------------------------
    def on_notification(self, peer_name: str, data: bytes, now: float) -> None:
        """Only the agent a prefill rank's Hello named may report on that rank's WRITEs."""
        peer = self.conns.by_agent.get(peer_name)
        sessions = [] if peer is None else [s for s in (peer.session, peer.last_session) if s is not None]
        if peer is None or not sessions:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush decode: notification from unknown NIXL agent %s dropped", ascii(peer_name))
            return
        try:
            try:  # sealed under the current session, or (re-handshaken) the one before it
                msg = sessions[0].open(data, b"notif")
            except WireError:
                if len(sessions) == 1:
                    raise
                msg = sessions[1].open(data, b"notif")
        except WireError as exc:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush: dropped a message from %s: %s", ascii(f"NIXL peer {peer_name}"), exc)
            return
        peer.last_heard = now
        reqs = self.requests
        if isinstance(msg, TransferDone | TransferFailed) and msg.prefill_rank != peer.rank:
            self.ledger.add(Count.REFUSED)
            log.warning(
                "kvpush decode: agent %s (prefill rank %s) reported for rank %s: dropped",
                ascii(peer_name),
                peer.rank,
                msg.prefill_rank,
            )
        elif isinstance(msg, TransferDone):
            reqs.landed(msg.request_id, msg.prefill_rank)
            reqs.apply(reqs.state.on_done(msg, now))
        elif isinstance(msg, TransferFailed):
            reqs.landed(msg.request_id, msg.prefill_rank)
            reqs.apply(reqs.state.on_failed(msg, now))
        else:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning(
                "kvpush decode: unexpected %s notification from %s", type(msg).__name__, ascii(peer_name)
            )

    # ---- the side channel -----------------------------------------------------------------------
    def drain(self, now: float) -> bool:
        """Read what every rank sent, at most max_messages_per_peer_round each (one chatty prefill cannot
        starve the others); a rank whose socket fails is failed, never the thread."""
        did = False
        for peer in list(self.conns.prefills.values()):
            if self.conns.get(peer.address, peer.rank) is not peer:
                continue  # dropped meanwhile (pruned to make room)
            try:
                for _ in range(self.limits.max_messages_per_peer_round):
                    reply = peer.channel.recv()
                    if reply is None:
                        break
                    did = True
                    self.on_reply(peer, reply, now)
            except CHANNEL_ERRORS as exc:
                self._fail_peer(peer, f"its side channel failed: {exc!r}", now)
        return did

    def on_reply(self, peer: PrefillPeer, data: bytes, now: float) -> None:
        msg = self.conns.open(peer, data)
        if isinstance(msg, Hint):
            self._on_hint(peer, msg, now)
        elif isinstance(msg, Hello):
            self._on_hello_reply(peer, msg, now)
        elif isinstance(msg, ErrorReply):
            self._on_error_reply(peer, msg, now)
        elif isinstance(msg, Posted) and peer.session is not None:
            # a hint only: poll fast for that notification while the request is still waited for
            if msg.prefill_rank == peer.rank and self.requests.state.tracks(msg.request_id):
                self.ledger.add(Count.NUDGES)
                self.requests.announce(msg.request_id, peer.rank, now + self.write_timeout_s)
        elif isinstance(msg, Ping | Pong):
            self.conns.heard(peer, msg.clock, now)
            if isinstance(msg, Ping):
                self.conns.send_sealed(peer, Pong(clock=now))
        elif msg is not None:
            self._unexpected(peer, msg)
        for ev in peer.waiters:
            ev.set()
        peer.waiters.clear()

    def _unexpected(self, peer: PrefillPeer, msg: Message) -> None:
        self.ledger.add(Count.WIRE_ERRORS)
        log.warning(
            "kvpush decode: unexpected %s on the side channel from %s", type(msg).__name__, ascii(peer.origin)
        )

    def _on_hello_reply(self, peer: PrefillPeer, msg: Hello, now: float) -> None:
        reqs = self.requests
        try:
            # the prefill's TP is bounded before any request's work grows with it (senders_for per expect)
            peer_layout = check_peer_hello(self.layout, msg, prefill_side=False)
            check_peer_tp(peer_layout, self.limits.max_peer_tp)
            self.conns.check_stages(peer, peer_layout, self.layout.global_layers)
        except LayoutError as exc:
            peer.error = str(exc)
            backlog, peer.backlog = peer.backlog, []  # never sent: those attempts fail now, by name
            for item in backlog:
                reqs.apply(reqs.refused(peer, item))
            return
        if peer.instance and peer.instance != msg.instance:
            # a new process answers at the old one's address: the old one is gone, and so are its WRITEs
            self.ledger.add(Count.PEERS_GONE)
            reqs.apply(reqs.state.on_peer_gone(peer.rank, "it restarted (a new instance answered)", now))
            # on_peer_gone ended every attempt this rank owed, those still waiting for this handshake
            # too: their registrations must not go out now, or the new instance would write blocks that
            # come back to the engine as failed (found by kvpush soak as stale writes after a restart)
            peer.backlog = []
        self.conns.start_session(peer, msg, now)
        backlog, peer.backlog = peer.backlog, []
        for item in backlog:
            reqs.apply(reqs.send_now(peer, item))
        reqs.release_held(now)

    def _on_error_reply(self, peer: PrefillPeer, msg: ErrorReply, now: float) -> None:
        """A refusal we can trust: sealed, or plain without a key (the local host is trusted), or plain
        before a session names no request (decode_conns.open drops the rest)."""
        reqs = self.requests
        if msg.code is ErrorCode.HELLO_FIRST:
            # the prefill does not know this connection: it restarted, or it dropped us (silent past its
            # peer_timeout_s, e.g. this process starved) and failed what we had registered there, and it
            # refuses what we sent since. Handshake again; what that rank owes ends now, by name, its
            # Aborts going out on the new session (the prefill frees its side at once, not at lease
            # expiry), its blocks back at the fence: waiting for it would hang until ready_timeout_s.
            self._rehandshake(peer, f"it no longer knows our side-channel connection ({msg.reason})", now)
            return
        if msg.request_id:
            failed = TransferFailed(
                request_id=msg.request_id,
                attempt=msg.attempt,
                prefill_rank=peer.rank,
                reason=msg.reason,
                abandoned=False,
            )
            reqs.apply(reqs.state.on_failed(failed, now, Failure.REFUSED))
            return
        peer.error = msg.reason
        log.error("kvpush decode: %s refused us: %s", ascii(peer.origin), msg.reason)

    def _on_hint(self, peer: PrefillPeer, hint: Hint, now: float) -> None:
        """An unauthenticated refusal on a keyed session: a restarted prefill (or one that dropped us) says
        exactly this, and so can anyone on the path. Handshake again (at most once per peer_timeout_s);
        end what the rank owes only if our own clock says it may have dropped us (we stalled past its
        timeout), and then fence-bound, as for silence."""
        if now - peer.last_hint < self.timeouts.peer_timeout_s:
            return
        peer.last_hint = now
        if self.conns.starved(peer, now):
            self._rehandshake(
                peer, f"we stalled past peer_timeout_s and it no longer knows us ({hint.reason})", now
            )
            return
        log.warning(
            "kvpush decode: handshaking again with %s after an unauthenticated hint", ascii(peer.origin)
        )
        self._reconnect(peer, now)

    def _rehandshake(self, peer: PrefillPeer, why: str, now: float) -> None:
        self._reconnect(peer, now)
        if self._in_use(peer) and self.requests.state.owed_by(peer.rank):
            self.requests.apply(self.requests.state.on_peer_silent(peer.rank, why, now))

    # ---- liveness -------------------------------------------------------------------------------
    def liveness(self, now: float) -> None:
        """Ping every prefill rank we talk to; a silent one ends its requests and is handshaken again, or
        dropped if nothing uses it and it never answered. One rank's failure never stops the others'."""
        self.conns.prune(now)
        for peer in list(self.conns.prefills.values()):
            try:
                self._check(peer, now)
            except CHANNEL_ERRORS as exc:  # a rank's sockets failed: that rank, not the thread
                self._fail_peer(peer, f"its side channel failed: {exc!r}", now)

    def _check(self, peer: PrefillPeer, now: float) -> None:
        why = self.conns.verify_closed(peer, now)
        if why:
            self._fail_peer(peer, why, now)
            return
        self.conns.ping(peer, now)
        heard = max(peer.last_heard, peer.connected_at)
        timeout = self.timeouts.peer_timeout_s
        if now - heard < timeout:
            return
        why = f"not heard from in {now - heard:.1f}s (peer_timeout_s {timeout})"
        reqs = self.requests
        if self._in_use(peer) and reqs.state.owed_by(peer.rank):
            self.ledger.add(Count.PEERS_GONE)
            if self.conns.gone_for_sure(peer):
                why = f"it closed the side channel and nothing listens at its address; {why}"
                reqs.apply(reqs.state.on_peer_gone(peer.rank, why, now))
            else:
                # neither silence nor a closed connection proves death: a frozen (SIGSTOPped) prefill
                # answers nothing, a reset relay closes a live one's connection, and either's WRITE in
                # flight (or one posted later for a registration it still holds) lands once it goes
                # on (issue 16: 1,021 bytes in reused blocks after a reset). Fence-bound.
                reqs.apply(reqs.state.on_peer_silent(peer.rank, why, now))
        for rid in reqs.waiting_for(peer, now):
            reqs.fail_held(rid, f"prefill rank {peer.rank} did not answer a handshake: {why}")
        self._reconnect(peer, now)

    def _reconnect(self, peer: PrefillPeer, now: float) -> None:
        why = self.conns.reconnect(peer, now)
        if why:
            self._fail_peer(peer, why, now)

    def _fail_peer(self, peer: PrefillPeer, why: str, now: float) -> None:
        """No connection to that rank: what it owes ends (fence-bound: it may still hold registrations),
        what waits for its handshake fails by name, and it is tried again at its next timeout."""
        reqs = self.requests
        if self._in_use(peer) and reqs.state.owed_by(peer.rank):
            reqs.apply(reqs.state.on_peer_silent(peer.rank, why, now))
        backlog, peer.backlog = peer.backlog, []
        for item in backlog:  # never sent
            reqs.apply(reqs.failed_send(item, peer.rank, why, Failure.PEER_GONE))
        for rid in reqs.waiting_for(peer, now):
            reqs.fail_held(rid, why, Failure.PEER_GONE)

    def _in_use(self, peer: PrefillPeer) -> bool:
        """Requests name this rank's address: its silence may end what its rank number owes. A rank
        nobody's request names (a pairing check, a bogus address) never ends another address's requests."""
        return peer.key in self.requests.addresses()
