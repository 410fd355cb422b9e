"""The decode endpoint: registers destination blocks with the prefill ranks and reports when their KV is in.

    decode = DecodeEndpoint(config, layout)
    decode.start()
    decode.connect(PrefillAddress(engine_id, host, port, tp_size))   # optional: refuse a mismatch early
    decode.expect(req_id, block_ids, num_tokens, PrefillAddress(...)) # returns at once
    for r in decode.finished(): r.ok and start_decoding(r.request_id)

Closing (or a dead transfer thread) deregisters the cache memory first, so no WRITE can land, and then
reports every live request as failed: the engine never waits for KV that cannot come.

Per prefill rank the receive thread keeps one side-channel connection with its own session (decode_conns.py):
registrations wait until the Hello is answered, then go out sealed, their expiry converted into the
prefill's clock (conservatively: with the largest `prefill clock - our clock at receipt` seen, which
never overstates the prefill's clock). Pings every ping_interval_s keep both sides informed; a prefill
not heard from for peer_timeout_s is silent (its requests end and come back at their fence) and is
re-handshaken on a fresh connection; an answer from a new instance at the same address proves the old
process gone (its requests come back at once) and the next request works. A closed connection is only a
hint (a reset relay closes a live prefill's too): it is answered with a fresh Hello at once, and requests
expected meanwhile wait for that answer (so a restarted prefill serves them). Notifications are honoured
only from the NIXL agent that the rank's Hello named, through that rank's session.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

from ..config import KVPushConfig
from ..errors import HandshakeTimeout, LayoutError, PeerRefused, WireError
from ..protocol.groups import TableArg
from ..protocol.handshake import check_peer_hello
from ..protocol.layout import KVLayout
from ..protocol.reasons import Failure
from ..protocol.receiver import Failed
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
from .base import (
    Endpoint,
    PrefillAddress,
    RecvResult,
    TransferHooks,
    TransportSource,
    checked_blocks,
)
from .control import ControlPlane
from .decode_conns import MAX_BACKLOG, PrefillConnections, PrefillPeer
from .decode_requests import DecodeRequests
from .held import HeldRequests
from .kept import decode_kept
from .stats import Count

log = logging.getLogger("kvpush")


class ReceiveThread(DecodeRequests):
    """The decode's transfer thread: the loop's step and what the prefill ranks say (NIXL notifications,
    side-channel replies, liveness); the engine's requests and their results are DecodeRequests'."""

    name = "kvpush-recv"
    role = "decode"

    def setup(self) -> None:
        self.transport, self.hello = self.setup_transport()
        self.conns = PrefillConnections(
            self.config, self.codec, self.hello, self.control, self.poller, self.ledger
        )
        self.held = HeldRequests(self.conns, self.layout, MAX_BACKLOG)  # while their rank re-handshakes

    def teardown(self) -> None:
        self.conns.close()
        self.transport.close()  # memory deregistered: from here on no WRITE can land in our blocks
        reason = "decode endpoint closed" if self.fatal is None else f"decode endpoint died: {self.fatal!r}"
        for act in self.state.close(reason):
            if isinstance(act, Failed):
                self._finish(act)
        for rid in self.held.ids():
            self._fail_held(rid, reason, Failure.CLOSED)

    def busy(self) -> bool:
        return self.state.waiting() > 0

    def in_flight(self) -> bool:
        return bool(self.announced)

    def tracked(self) -> int:
        return len(self.state) + len(self.held)

    def kept(self) -> dict[str, int]:
        return decode_kept(self)

    def describe(self, request_id: str) -> str:
        return self.state.describe(request_id, time.monotonic())

    def step(self, now: float) -> bool:
        did = False
        for peer_name, data in self.transport.drain_notifs():
            did = True
            self._on_notification(peer_name, data, now)
        for peer in list(self.conns.prefills.values()):
            for _ in range(
                self.config.limits.max_messages_per_peer_round
            ):  # one chatty prefill cannot starve others
                reply = peer.channel.recv()
                if reply is None:
                    break
                did = True
                self._on_reply(peer, reply, now)
        if self.tick_due(now):
            if self.announced:
                self.announced = {k: t for k, t in self.announced.items() if t > now}
            self._liveness(now)
            self._apply(self.state.on_tick(now))
            self.ledger.pending(len(self.state))
            self.ledger.peers(self.conns.live())
        return did

    def _on_notification(self, peer_name: str, data: bytes, now: float) -> None:
        """Only the agent a prefill rank's Hello named may report on that rank's WRITEs."""
        peer = self.conns.by_agent.get(peer_name)
        sessions = [] if peer is None else [s for s in (peer.session, peer.last_session) if s is not None]
        if peer is None or not sessions:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush decode: notification from unknown NIXL agent %s dropped", ascii(peer_name))
            return

        def opened(d: bytes) -> Message:
            """Sealed under the current session, or (re-handshaken) the one before it."""
            try:
                return sessions[0].open(d, b"notif")
            except WireError:
                if len(sessions) == 1:
                    raise
            return sessions[1].open(d, b"notif")

        msg = self.decode_or_count(data, f"NIXL peer {peer_name}", opened)
        if msg is None:
            return
        peer.last_heard = now
        if isinstance(msg, TransferDone | TransferFailed) and msg.prefill_rank != peer.rank:
            self.ledger.add(Count.REFUSED)
            log.warning(
                "kvpush decode: agent %s (prefill rank %s) reported for rank %s: dropped",
                ascii(peer_name),
                peer.rank,
                msg.prefill_rank,
            )
        elif isinstance(msg, TransferDone):
            self.announced.pop((msg.request_id, msg.prefill_rank), None)
            self._apply(self.state.on_done(msg, now))
        elif isinstance(msg, TransferFailed):
            self.announced.pop((msg.request_id, msg.prefill_rank), None)
            self._apply(self.state.on_failed(msg, now))
        else:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning(
                "kvpush decode: unexpected %s notification from %s", type(msg).__name__, ascii(peer_name)
            )

    def _liveness(self, now: float) -> None:
        """Ping every prefill rank we talk to; a silent one ends its requests and is handshaken again."""
        cfg = self.config
        for peer in list(self.conns.prefills.values()):
            self.conns.verify_closed(peer, now)
            self.conns.ping(peer, now)
            heard = max(peer.last_heard, peer.connected_at)
            if now - heard < cfg.liveness.peer_timeout_s:
                continue
            why = f"not heard from in {now - heard:.1f}s (peer_timeout_s {cfg.liveness.peer_timeout_s})"
            if self.state.owed_by(peer.rank):
                self.ledger.add(Count.PEERS_GONE)
                if self.conns.gone_for_sure(peer):
                    why = f"it closed the side channel and nothing listens at its address; {why}"
                    self._apply(self.state.on_peer_gone(peer.rank, why, now))
                else:
                    # neither silence nor a closed connection proves death: a frozen (SIGSTOPped) prefill
                    # answers nothing, a reset relay closes a live one's connection, and either's WRITE in
                    # flight (or one posted later for a registration it still holds) lands once it goes
                    # on (issue 16: 1,021 bytes in reused blocks after a reset). Fence-bound.
                    self._apply(self.state.on_peer_silent(peer.rank, why, now))
            for rid in self.held.waiting_for(peer, now):
                self._fail_held(rid, f"prefill rank {peer.rank} did not answer a handshake: {why}")
            self.conns.reconnect(peer, now)

    def _on_reply(self, peer: PrefillPeer, data: bytes, now: float) -> None:
        msg = self.conns.open(peer, data)
        if isinstance(msg, Hello):
            self._on_hello_reply(peer, msg, now)
        elif isinstance(msg, ErrorReply):
            self._on_error_reply(peer, msg, now)
        elif isinstance(msg, Posted) and peer.session is not None:
            # a hint only: poll fast for that notification while the request is still waited for
            if msg.prefill_rank == peer.rank and self.state.tracks(msg.request_id):
                self.ledger.add(Count.NUDGES)
                self.announced[(msg.request_id, peer.rank)] = now + self.config.leases.write_timeout_s
        elif isinstance(msg, Ping | Pong):
            self.conns.heard(peer, msg.clock, now)
            if isinstance(msg, Ping):
                self.conns.send_sealed(peer, Pong(clock=now))
        elif msg is not None:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning(
                "kvpush decode: unexpected %s on the side channel from %s",
                type(msg).__name__,
                ascii(peer.origin),
            )
        for ev in peer.waiters:
            ev.set()
        peer.waiters.clear()

    def _on_hello_reply(self, peer: PrefillPeer, msg: Hello, now: float) -> None:
        try:
            # the prefill's TP is bounded before any request's work grows with it (senders_for per expect)
            peer_layout = check_peer_hello(self.layout, msg, prefill_side=False)
            check_peer_tp(peer_layout, self.config.limits.max_peer_tp)
            self.conns.check_stages(peer, peer_layout, self.layout.global_layers)
        except LayoutError as exc:
            peer.error = str(exc)
            backlog, peer.backlog = peer.backlog, []  # never sent: those attempts fail now, by name
            for item in backlog:
                self._apply(self._refused(peer, item))
            return
        if peer.instance and peer.instance != msg.instance:
            # a new process answers at the old one's address: the old one is gone, and so are its WRITEs
            self.ledger.add(Count.PEERS_GONE)
            self._apply(self.state.on_peer_gone(peer.rank, "it restarted (a new instance answered)", now))
            # on_peer_gone ended every attempt this rank owed, those still waiting for this handshake
            # too: their registrations must not go out now, or the new instance would write blocks that
            # come back to the engine as failed (found by kvpush soak as stale writes after a restart)
            peer.backlog = []
        self.conns.start_session(peer, msg, now)
        backlog, peer.backlog = peer.backlog, []
        for item in backlog:
            self._apply(self._send_now(peer, item))
        for rid, held in self.held.ready(now):
            self.cmd_expect(rid, held.blocks, held.num_tokens, held.prefill)

    def _on_error_reply(self, peer: PrefillPeer, msg: ErrorReply, now: float) -> None:
        if msg.code is ErrorCode.HELLO_FIRST:
            # the prefill does not know this connection: it restarted, or it dropped us (silent past its
            # peer_timeout_s, e.g. this process starved) and failed what we had registered there, and it
            # refuses what we sent since. Handshake again; what that rank owes ends now, by name, its
            # Aborts going out on the new session (the prefill frees its side at once, not at lease
            # expiry), its blocks back at the fence: waiting for it would hang until ready_timeout_s.
            self.conns.reconnect(peer, now)
            if self.state.owed_by(peer.rank):
                why = f"it no longer knows our side-channel connection ({msg.reason})"
                self._apply(self.state.on_peer_silent(peer.rank, why, now))
            return
        if msg.request_id:
            self._apply(
                self.state.on_failed(
                    TransferFailed(
                        request_id=msg.request_id,
                        attempt=msg.attempt,
                        prefill_rank=peer.rank,
                        reason=msg.reason,
                        abandoned=False,
                    ),
                    now,
                    Failure.REFUSED,
                )
            )
            return
        peer.error = msg.reason
        log.error(
            "kvpush decode: prefill %s rank %s refused us: %s",
            ascii(peer.address.engine_id),
            peer.rank,
            msg.reason,
        )


class DecodeEndpoint(Endpoint[RecvResult]):
    """One decode rank: registers destination blocks with prefill and reports when their KV is ready."""

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str = "DRAM",
        transport: TransportSource = None,
        control: ControlPlane | None = None,
        hooks: TransferHooks | None = None,
    ) -> None:
        self._recv = ReceiveThread(config, layout, mem_type, transport, control, hooks)
        super().__init__(config, layout, self._recv)

    def connect(self, prefill: PrefillAddress, timeout: float | None = None) -> None:
        """Handshake with every prefill rank this rank needs, now; PeerRefused (a LayoutError) on a
        mismatch either side finds, HandshakeTimeout if a rank does not answer.

        Optional: expect() connects lazily. Call it at start-up to refuse an incompatible pair early.
        """
        timeout = self.config.liveness.handshake_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            done = threading.Event()
            peers = self._recv.call(functools.partial(self._recv.cmd_connect, prefill, done), timeout)
            while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                self._recv.alive_or_raise()
                if time.monotonic() >= deadline:
                    raise HandshakeTimeout(
                        f"no handshake answer from prefill {prefill.engine_id!r} at "
                        f"{prefill.host}:{prefill.port} within {timeout}s"
                    )
            self._recv.alive_or_raise()
            errors = [p.error for p in peers if p.error]
            if errors:
                raise PeerRefused(f"prefill {prefill.engine_id!r} refused the pairing: {errors[0]}")
            if all(p.session is not None for p in peers):
                return

    def expect(self, request_id: str, block_ids: TableArg, num_tokens: int, prefill: PrefillAddress) -> None:
        """Blocks are allocated for request_id's KV: one table, or one per KV-cache group of the layout
        (a sliding-window group's table may hold -1 for blocks outside the window). With a PP prefill
        (prefill.pp_size stages) the request is ready once every stage's layers landed."""
        limit = self.config.limits.max_message_bytes
        blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens, limit)
        self._recv.submit(lambda: self._recv.cmd_expect(request_id, blocks, num_tokens, prefill))

    def abort(self, request_id: str, reason: str = "aborted by decode engine") -> None:
        self._recv.submit(lambda: self._recv.cmd_abort(request_id, reason))

    def cancel(
        self, request_id: str, prefill: PrefillAddress, reason: str = "cancelled by decode engine"
    ) -> None:
        """Like abort(), but also for a request expect() never saw (dropped before allocation): the
        prefill ranks that would have written it are told, and free its blocks at once."""
        self._recv.submit(lambda: self._recv.cmd_cancel(request_id, prefill, reason))
