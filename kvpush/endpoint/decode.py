"""The decode endpoint: registers destination blocks with the prefill ranks and reports when their KV is in.

    decode = DecodeEndpoint(config, layout)
    decode.start()
    decode.connect(PrefillAddress(engine_id, host, port, tp_size))   # optional: refuse a mismatch early
    decode.expect(req_id, block_ids, num_tokens, PrefillAddress(...)) # returns at once
    for r in decode.finished(): r.ok and start_decoding(r.request_id)

Closing (or a dead transfer thread) deregisters the cache memory first, so no WRITE can land, and then
reports every live request as failed: the engine never waits for KV that cannot come.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import zmq

from ..config import KVPushConfig
from ..errors import HandshakeTimeout, LayoutError, PeerRefused, TransportError
from ..protocol.handshake import check_peer_hello
from ..protocol.layout import KVLayout
from ..protocol.receiver import (
    Discarded,
    Failed,
    Ready,
    ReceiverAction,
    ReceiverState,
    SendAbort,
    SendRegistration,
)
from ..protocol.tp import senders_for
from ..protocol.wire import ErrorReply, Hello, TransferDone, TransferFailed
from ..transport.base import Transport
from .base import Endpoint, EndpointWorker, PrefillAddress, RecvResult, TransferHooks, checked_blocks
from .control import ControlChannel, ControlPlane

log = logging.getLogger("kvpush")


@dataclass
class _PrefillPeer:
    address: PrefillAddress
    rank: int
    channel: ControlChannel
    hello: Hello | None = None
    error: str = ""
    waiters: list[threading.Event] = field(default_factory=list)


class ReceiveWorker(EndpointWorker[RecvResult]):
    name = "kvpush-recv"
    role = "decode"

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str,
        transport: Transport | Callable[[], Transport] | None,
        control: ControlPlane | None,
        hooks: TransferHooks | None = None,
    ) -> None:
        super().__init__(config, layout, mem_type, transport, control, hooks)
        self.state = ReceiverState(
            config.engine_id, layout.tp_rank, layout.tp_size, layout.total_kv_heads, config.ready_timeout_s
        )
        self.prefills: dict[tuple[str, int], _PrefillPeer] = {}
        self.route: dict[str, PrefillAddress] = {}  # request -> its prefill engine

    def setup(self) -> None:
        self.transport, self.hello = self.setup_transport()

    def teardown(self) -> None:
        for peer in self.prefills.values():
            peer.channel.close()
            for ev in peer.waiters:
                ev.set()
        self.transport.close()  # memory deregistered: from here on no WRITE can land in our blocks
        reason = "decode endpoint closed" if self.fatal is None else f"decode endpoint died: {self.fatal!r}"
        for act in self.state.close(reason):
            if isinstance(act, Failed):
                self._finish(act)

    def busy(self) -> bool:
        return self.state.waiting() > 0

    def tracked(self) -> int:
        return len(self.state)

    def step(self, now: float) -> bool:
        did = False
        for peer_name, data in self.transport.drain_notifs():
            did = True
            msg = self.decode_or_count(data, f"NIXL peer {peer_name}")
            if isinstance(msg, TransferDone):
                self._apply(self.state.on_done(msg, now))
            elif isinstance(msg, TransferFailed):
                self._apply(self.state.on_failed(msg, now))
            elif msg is not None:
                self.ledger.add("wire_errors")
                log.warning(
                    "kvpush decode: unexpected %s notification from %s", type(msg).__name__, peer_name
                )
        for peer in list(self.prefills.values()):
            for _ in range(64):  # bounded per peer and round: one chatty prefill cannot starve the others
                reply = peer.channel.recv()
                if reply is None:
                    break
                did = True
                self._on_reply(peer, reply, now)
        if self.tick_due(now):
            self._apply(self.state.on_tick(now))
            self.ledger.pending(len(self.state))
        return did

    def _peer(self, address: PrefillAddress, rank: int) -> _PrefillPeer:
        key = (address.engine_id, rank)
        peer = self.prefills.get(key)
        if peer is None:
            channel = self.control.connect(
                address.host, address.rank_port(rank), self.config.max_message_bytes
            )
            self.poller.register(channel.pollable, zmq.POLLIN)
            peer = self.prefills[key] = _PrefillPeer(address, rank, channel)
            # messages on one channel arrive in order: the hello is processed before any registration
            channel.send(self.codec.encode(self.hello))
        return peer

    def _on_reply(self, peer: _PrefillPeer, data: bytes, now: float) -> None:
        msg = self.decode_or_count(data, f"prefill {peer.address.engine_id} rank {peer.rank}")
        if isinstance(msg, Hello):
            try:
                check_peer_hello(self.layout, msg, prefill_side=False)
                peer.hello, peer.error = msg, ""
            except LayoutError as exc:
                peer.error = str(exc)
        elif isinstance(msg, ErrorReply):
            if msg.request_id:
                self._apply(
                    self.state.on_failed(
                        TransferFailed(
                            request_id=msg.request_id,
                            attempt=msg.attempt,
                            prefill_rank=peer.rank,
                            reason=msg.reason,
                        ),
                        now,
                    )
                )
            else:
                peer.error = msg.reason
                log.error(
                    "kvpush decode: prefill %s rank %s refused us: %s",
                    peer.address.engine_id,
                    peer.rank,
                    msg.reason,
                )
        elif msg is not None:
            self.ledger.add("wire_errors")
            log.warning(
                "kvpush decode: unexpected %s on the side channel from prefill %s rank %s",
                type(msg).__name__,
                peer.address.engine_id,
                peer.rank,
            )
        for ev in peer.waiters:
            ev.set()
        peer.waiters.clear()

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
                self.ledger.add("discarded")
                log.debug("kvpush decode: %s", act.reason)

    def _send(self, act: SendRegistration | SendAbort) -> list[ReceiverAction]:
        address = self.route.get(act.message.request_id)
        if address is None:
            return []
        peer = self._peer(address, act.prefill_rank)
        try:
            peer.channel.send(self.codec.encode(act.message))
        except TransportError as exc:
            return self.state.on_failed(
                TransferFailed(
                    request_id=act.message.request_id,
                    attempt=act.message.attempt,
                    prefill_rank=act.prefill_rank,
                    reason=f"side channel send failed: {exc}",
                ),
                time.monotonic(),
            )
        return []

    def _finish(self, act: Ready | Failed) -> None:
        now = time.monotonic()
        if not self.state.tracks(act.request_id):
            self.route.pop(act.request_id, None)
        if isinstance(act, Ready) and self.hooks is not None:
            try:
                self.hooks.after_receive(act.request_id, act.block_ids)
            except Exception as exc:  # noqa: BLE001 - the request fails with the reason; the thread lives
                act = Failed(
                    act.request_id, act.attempt, act.block_ids, f"staging into the cache failed: {exc!r}"
                )
            now = time.monotonic()
        if isinstance(act, Ready):
            self.ledger.add("bytes", act.nbytes)
            result = RecvResult(act.request_id, True, act.block_ids, "", act.nbytes, now)
        else:
            result = RecvResult(act.request_id, False, act.block_ids, act.reason, 0, now)
        self.ledger.finished(result.ok)
        self.put_result(result)

    # ---- commands -----------------------------------------------------------------------------
    def cmd_expect(
        self, request_id: str, blocks: tuple[int, ...], num_tokens: int, prefill: PrefillAddress
    ) -> None:
        self.route[request_id] = prefill
        self._apply(self.state.expect(request_id, blocks, num_tokens, prefill.tp_size, time.monotonic()))

    def cmd_abort(self, request_id: str, reason: str) -> None:
        self._apply(self.state.abort(request_id, reason, time.monotonic()))

    def cmd_cancel(self, request_id: str, prefill: PrefillAddress, reason: str) -> None:
        self.route.setdefault(request_id, prefill)
        self._apply(self.state.cancel(request_id, prefill.tp_size, reason, time.monotonic()))
        if not self.state.tracks(request_id):
            self.route.pop(request_id, None)

    def cmd_connect(self, prefill: PrefillAddress, done: threading.Event) -> list[_PrefillPeer]:
        ranks = senders_for(
            self.layout.tp_rank, self.layout.tp_size, prefill.tp_size, self.layout.total_kv_heads
        )
        peers = [self._peer(prefill, r) for r in ranks]
        pending = [p for p in peers if p.hello is None and not p.error]
        if not pending:
            done.set()
        for p in pending:
            p.waiters.append(done)
        return peers


class DecodeEndpoint(Endpoint[RecvResult]):
    """One decode rank: registers destination blocks with prefill and reports when their KV is ready."""

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str = "DRAM",
        transport: Transport | Callable[[], Transport] | None = None,
        control: ControlPlane | None = None,
        hooks: TransferHooks | None = None,
    ) -> None:
        self._recv = ReceiveWorker(config, layout, mem_type, transport, control, hooks)
        super().__init__(config, layout, self._recv)

    def connect(self, prefill: PrefillAddress, timeout: float | None = None) -> None:
        """Handshake with every prefill rank this rank needs, now; PeerRefused (a LayoutError) on a
        mismatch either side finds, HandshakeTimeout if a rank does not answer.

        Optional: expect() connects lazily. Call it at start-up to refuse an incompatible pair early.
        """
        timeout = self.config.handshake_timeout_s if timeout is None else timeout
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
            if all(p.hello is not None for p in peers):
                return

    def expect(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int, prefill: PrefillAddress
    ) -> None:
        blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens)
        self._recv.submit(lambda: self._recv.cmd_expect(request_id, blocks, num_tokens, prefill))

    def abort(self, request_id: str, reason: str = "aborted by decode engine") -> None:
        self._recv.submit(lambda: self._recv.cmd_abort(request_id, reason))

    def cancel(
        self, request_id: str, prefill: PrefillAddress, reason: str = "cancelled by decode engine"
    ) -> None:
        """Like abort(), but also for a request expect() never saw (dropped before allocation): the
        prefill ranks that would have written it are told, and free its blocks at once."""
        self._recv.submit(lambda: self._recv.cmd_cancel(request_id, prefill, reason))
