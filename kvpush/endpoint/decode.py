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

import contextlib
import functools
import logging
import threading
import time

from ..config import KVPushConfig
from ..errors import EndpointClosed, HandshakeTimeout, PeerRefused
from ..protocol.groups import TableArg
from ..protocol.layout import KVLayout
from ..protocol.reasons import Failure
from ..protocol.receiver import Failed
from .base import (
    Endpoint,
    EndpointCore,
    PrefillAddress,
    RecvResult,
    TransferHooks,
    TransportSource,
    checked_blocks,
)
from .control import ControlPlane
from .decode_conns import PrefillConnections, PrefillPeer
from .decode_replies import PrefillReplies
from .decode_requests import DecodeRequests
from .kept import decode_kept
from .loop import LoopRole, TransferLoop, idle_wait_ms

log = logging.getLogger("kvpush")


class ReceiveThread:
    """The decode rank's role on its TransferLoop: the loop's step over three collaborators built at setup
    (once the transport exists): the prefill connections, the requests (records, machine, pump) and the
    replies (what the prefill ranks say, and their liveness)."""

    name = "kvpush-recv"

    def __init__(
        self, core: EndpointCore[RecvResult], loop: TransferLoop[LoopRole], hooks: TransferHooks | None
    ) -> None:
        self.core, self.loop, self.hooks = core, loop, hooks
        self.config, self.layout, self.ledger = core.config, core.layout, core.ledger
        self.tick_due = core.tick_due

    def setup(self) -> None:
        cfg, core = self.config, self.core
        self.transport, hello = core.setup_transport()
        self.conns = PrefillConnections(
            cfg.limits, cfg.liveness, cfg.security.hmac_key, core.codec, hello, core.control,
            self.loop.poller, self.ledger, lambda: self.requests.addresses(),
        )  # fmt: skip
        self.requests = DecodeRequests(
            cfg.engine_id, self.layout, cfg.leases, cfg.liveness, self.conns, self.ledger, self.hooks,
            core.put_result,
        )  # fmt: skip
        self.replies = PrefillReplies(
            self.layout, cfg.limits, cfg.liveness, cfg.leases.write_timeout_s, self.conns, self.requests,
            self.ledger,
        )  # fmt: skip

    def teardown(self) -> None:
        self.conns.close()
        self.transport.close()  # memory deregistered: from here on no WRITE can land in our blocks
        fatal = self.loop.fatal
        reason = "decode endpoint closed" if fatal is None else f"decode endpoint died: {fatal!r}"
        reqs = self.requests
        for act in reqs.state.close(reason):
            if isinstance(act, Failed):
                reqs.finish(act)
        for rid in reqs.held_ids():
            reqs.fail_held(rid, reason, Failure.CLOSED)

    def busy(self) -> bool:
        return self.requests.state.waiting() > 0

    def in_flight(self) -> bool:
        return self.requests.announced > 0

    def idle_wait_ms(self) -> int:
        return idle_wait_ms(self.config.pacing, self.tracked())

    def wound_down(self) -> None:
        self.core.wound_down()

    def tracked(self) -> int:
        return len(self.requests.state) + self.requests.held

    def kept(self) -> dict[str, int]:
        return decode_kept(self.requests, self.conns)

    def describe(self, request_id: str) -> str:
        return self.requests.state.describe(request_id, time.monotonic())

    def step(self, now: float) -> bool:
        did = False
        for peer_name, data in self.transport.drain_notifs():
            did = True
            self.replies.on_notification(peer_name, data, now)
        did = self.replies.drain(now) or did
        if self.tick_due(now):
            reqs = self.requests
            reqs.expire_announced(now)
            self.replies.liveness(now)
            reqs.apply(reqs.state.on_tick(now))
            self.ledger.pending(len(reqs.state))
            self.ledger.peers(self.conns.live())
        return did


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
        core = EndpointCore[RecvResult](config, "decode", layout, mem_type, transport, control)
        loop: TransferLoop[ReceiveThread] = TransferLoop(
            config.pacing, lambda loop: ReceiveThread(core, loop, hooks)
        )
        self._recv = loop.role
        super().__init__(config, layout, core, loop)

    def connect(self, prefill: PrefillAddress, timeout: float | None = None) -> None:
        """Handshake with every prefill rank this rank needs, now; PeerRefused (a LayoutError) on a
        mismatch either side finds, HandshakeTimeout if a rank does not answer.

        Optional: expect() connects lazily. Call it at start-up to refuse an incompatible pair early.
        """
        timeout = self.config.liveness.handshake_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            done = threading.Event()
            peers, full = self._loop.call(functools.partial(self._connect, prefill, done), timeout)
            if full:
                raise PeerRefused(f"cannot pair with prefill {prefill.engine_id!r}: {full}")
            try:
                while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                    self._loop.alive_or_raise()
                    if time.monotonic() >= deadline:
                        raise HandshakeTimeout(
                            f"no handshake answer from prefill {prefill.engine_id!r} at "
                            f"{prefill.host}:{prefill.port} within {timeout}s"
                        )
            finally:
                if not done.is_set():  # nobody waits any more: the ranks may be pruned
                    with contextlib.suppress(EndpointClosed):
                        self._loop.submit(functools.partial(self._recv.requests.unwait, peers, done))
            self._loop.alive_or_raise()
            errors = [p.error for p in peers if p.error]
            if errors:
                raise PeerRefused(f"prefill {prefill.engine_id!r} refused the pairing: {errors[0]}")
            if all(p.session is not None for p in peers):
                return

    def _connect(self, prefill: PrefillAddress, done: threading.Event) -> tuple[list[PrefillPeer], str]:
        return self._recv.requests.connect(prefill, done)  # on the thread: requests exists from setup

    def expect(self, request_id: str, block_ids: TableArg, num_tokens: int, prefill: PrefillAddress) -> None:
        """Blocks are allocated for request_id's KV: one table, or one per KV-cache group of the layout
        (a sliding-window group's table may hold -1 for blocks outside the window). With a PP prefill
        (prefill.pp_size stages) the request is ready once every stage's layers landed."""
        limit = self.config.limits.max_message_bytes
        blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens, limit)
        self._loop.submit(lambda: self._recv.requests.expect(request_id, blocks, num_tokens, prefill))

    def abort(self, request_id: str, reason: str = "aborted by decode engine") -> None:
        self._loop.submit(lambda: self._recv.requests.abort(request_id, reason))

    def cancel(
        self, request_id: str, prefill: PrefillAddress, reason: str = "cancelled by decode engine"
    ) -> None:
        """Like abort(), but also for a request expect() never saw (dropped before allocation): the
        prefill ranks that would have written it are told, and free its blocks at once."""
        self._loop.submit(lambda: self._recv.requests.cancel(request_id, prefill, reason))
