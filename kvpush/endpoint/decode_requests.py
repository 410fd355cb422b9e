"""The request side of the decode's receive thread: what the engine asks for (expect, abort, cancel,
connect), the action pump that turns the receiver machine's actions into Registrations and Aborts sent to
the prefill ranks, and the results reported back to the engine.

`DecodeRequests` is the base of `ReceiveThread` (decode.py), which adds the loop's step and what the
prefill ranks say (notifications, side-channel replies, liveness); kept apart so that the path a request
takes out, and the way its end is reported, read in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

import msgspec

from ..errors import TransportError, WireError
from ..protocol.groups import BlockIds
from ..protocol.reasons import Failure
from ..protocol.receiver import (
    Discarded,
    Failed,
    Ready,
    ReceiverAction,
    ReceiverState,
    SendAbort,
    SendRegistration,
)
from ..protocol.tp import stage_senders
from ..protocol.wire import Abort, Registration, TransferFailed
from .base import EndpointThread, PrefillAddress, RecvResult
from .decode_conns import MAX_BACKLOG, PrefillConnections, PrefillPeer
from .held import Held, HeldRequests
from .stats import Count

log = logging.getLogger("kvpush")


class DecodeRequests(EndpointThread[RecvResult]):
    """Needs `conns` and `held` from the thread's setup (decode.py); builds the machine and the maps."""

    conns: PrefillConnections
    held: HeldRequests  # new requests for a prefill rank being handshaken again

    def init_role(self) -> None:
        config, layout = self.config, self.layout
        self.state = ReceiverState(
            config.engine_id,
            layout.tp_rank,
            layout.tp_size,
            layout.total_kv_heads,
            config.leases.ready_timeout_s,
            config.leases.write_bound_s,
            gone_linger_s=config.leases.write_linger_s,
            abort_resend_s=config.liveness.ping_interval_s,
        )
        self.route: dict[str, PrefillAddress] = {}  # request -> its prefill engine
        self.expected_at: dict[str, float] = {}  # request -> when expect() reached this thread
        # requests a prefill rank announced (Posted) and whose notification has not come: poll fast until
        # it does (or until the deadline, write_timeout_s on, after which the ticks' pace is enough)
        self.announced: dict[tuple[str, int], float] = {}

    # ---- the action pump ----------------------------------------------------------------------
    def _apply(self, actions: Iterable[ReceiverAction]) -> None:
        """Run actions and their follow-ups in order; executors return follow-ups, never re-enter."""
        pending = deque(actions)
        while pending:
            act = pending.popleft()
            if isinstance(act, SendRegistration | SendAbort):
                pending.extend(self._send(act))
            elif isinstance(act, Ready | Failed):
                self._finish(act)
            elif isinstance(act, Discarded):
                self.ledger.add(Count.DISCARDED)
                log.debug("kvpush decode: %s", act.reason)

    def _send(self, act: SendRegistration | SendAbort) -> list[ReceiverAction]:
        address = self.route.get(act.message.request_id)
        if address is None:
            return []
        peer = self.conns.peer(address, act.prefill_rank, time.monotonic())
        repeat = isinstance(act, SendAbort) and act.repeat
        if peer.session is None:
            if peer.error:
                return self._refused(peer, act.message)
            if repeat:
                return []  # a resend: the next one goes out once the handshake is done
            if len(peer.backlog) >= MAX_BACKLOG:
                why = "too many messages wait for its handshake"
                return self._failed_send(act.message, act.prefill_rank, why, Failure.REFUSED)
            peer.backlog.append(act.message)
            return []
        return self._send_now(peer, act.message, repeat)

    def _send_now(
        self, peer: PrefillPeer, msg: Registration | Abort, repeat: bool = False
    ) -> list[ReceiverAction]:
        assert peer.session is not None
        if isinstance(msg, Registration):
            # our expiry in the prefill's clock: the offset never overstates the prefill's clock, so the
            # prefill stops posting no later than our own expiry
            msg = msgspec.structs.replace(
                msg, expires_at=max(0.0, msg.expires_at + (peer.clock_offset or 0.0))
            )
        try:
            peer.channel.send(peer.session.seal(msg))
        except (TransportError, WireError) as exc:
            if repeat:  # the first Abort went out; a failed repeat proves nothing about the WRITEs
                return []
            return self._failed_send(msg, peer.rank, f"side channel send failed: {exc}", Failure.PEER_GONE)
        return []

    def _refused(self, peer: PrefillPeer, msg: Registration | Abort) -> list[ReceiverAction]:
        """The rank refused the pairing: nothing can be registered there, so the attempt fails now, by name."""
        if isinstance(msg, Abort):
            return []  # nothing was registered there to stop
        return self._failed_send(msg, peer.rank, f"{peer.origin} refused: {peer.error}", Failure.REFUSED)

    def _failed_send(
        self, msg: Registration | Abort, rank: int, reason: str, kind: Failure
    ) -> list[ReceiverAction]:
        """Nothing was sent, so nothing can be written from it: the attempt fails for this rank now."""
        return self.state.on_failed(
            TransferFailed(
                request_id=msg.request_id,
                attempt=msg.attempt,
                prefill_rank=rank,
                reason=reason,
                abandoned=False,
            ),
            time.monotonic(),
            kind,
        )

    def _finish(self, act: Ready | Failed) -> None:
        now = time.monotonic()
        if self.announced:
            for key in [k for k in self.announced if k[0] == act.request_id]:
                del self.announced[key]
        expected_at = self.expected_at.get(act.request_id)
        if not self.state.tracks(act.request_id):
            self.route.pop(act.request_id, None)
            self.expected_at.pop(act.request_id, None)
        if isinstance(act, Ready) and self.hooks is not None:
            try:
                self.hooks.after_receive(act.request_id, act.block_ids)
            except Exception as exc:  # noqa: BLE001 - the request fails with the reason; the thread lives
                why = f"staging into the cache failed: {exc!r}"
                act = Failed(act.request_id, act.attempt, act.block_ids, why, Failure.WRITE_FAILED)
            now = time.monotonic()
        if isinstance(act, Ready):
            self.ledger.add(Count.BYTES, act.nbytes)
            result = RecvResult(act.request_id, True, act.block_ids, "", act.nbytes, now)
        else:
            result = RecvResult(act.request_id, False, act.block_ids, act.reason, 0, now, act.kind)
        latency = None if expected_at is None else now - expected_at
        self.ledger.finished(result.ok, latency, result.failure)
        self.put_result(result)

    def _fail_held(self, request_id: str, reason: str, kind: Failure = Failure.PEER_SILENT) -> None:
        """Nothing was registered for a held request, so nothing can be written: it fails at once."""
        self._finish(Failed(request_id, 0, self.held.pop(request_id).blocks, reason, kind))

    # ---- commands -----------------------------------------------------------------------------
    def cmd_expect(self, request_id: str, blocks: BlockIds, num_tokens: int, prefill: PrefillAddress) -> None:
        now = time.monotonic()
        fresh = not self.state.tracks(request_id) and request_id not in self.held
        if fresh and self.held.rehandshaking(prefill, now) is not None:
            if not self.held.hold(request_id, Held(blocks, num_tokens, prefill)):
                why = "too many requests wait for a prefill handshake"
                self._finish(Failed(request_id, 0, blocks, why, Failure.REFUSED))
            return
        self.route[request_id] = prefill
        self.expected_at[request_id] = now
        self._apply(self.state.expect(request_id, blocks, num_tokens, prefill.tp_size, now, prefill.pp_size))

    def cmd_abort(self, request_id: str, reason: str) -> None:
        if request_id in self.held:
            self._fail_held(request_id, reason, Failure.ABORTED)
            return
        self._apply(self.state.abort(request_id, reason, time.monotonic()))

    def cmd_cancel(self, request_id: str, prefill: PrefillAddress, reason: str) -> None:
        if request_id in self.held:
            self._fail_held(request_id, reason, Failure.ABORTED)
            return
        self.route.setdefault(request_id, prefill)
        self._apply(self.state.cancel(request_id, prefill.tp_size, reason, time.monotonic(), prefill.pp_size))
        if not self.state.tracks(request_id):
            self.route.pop(request_id, None)
            self.expected_at.pop(request_id, None)

    def cmd_connect(self, prefill: PrefillAddress, done: threading.Event) -> list[PrefillPeer]:
        ranks = stage_senders(
            self.layout.tp_rank,
            self.layout.tp_size,
            prefill.tp_size,
            prefill.pp_size,
            self.layout.total_kv_heads,
        )
        now = time.monotonic()
        peers = [self.conns.peer(prefill, r, now) for r in ranks]
        pending = [p for p in peers if p.session is None and not p.error]
        if not pending:
            done.set()
        for p in pending:
            p.waiters.append(done)
        return peers
