"""Making a WRITE: the sender machine's StartWrite and its decode peer become a WRITE ready to post.

For one StartWrite the maker routes to the decode rank (peers.py), makes the source ready (the engine's
KV-written barriers, then staging), plans the bytes (indices into the pair's prepared lists, using a side
planned before the trigger when there is one), seals the notification for the peer's session and returns
the WRITE as data (posting.py's WriteSpec) for the scheduler to queue. An `Arm` makes the same WRITE ahead of
prefill_done and keeps it unposted in the armed store (armed.py); prefill_done's StartWrite then takes it.
The push thread calls it and keeps the per-request record (push_request.py) it reads and marks.
"""

from __future__ import annotations

import logging
import time

from ..errors import LayoutError, TransportError
from ..protocol.groups import BlockIds
from ..protocol.layout import KVLayout
from ..protocol.order import NOTIF, sealed_done, write_plan
from ..protocol.plan import TransferPlan
from ..protocol.prepared import IndexPlan, PairUnits, build_index_plan, half_plan
from ..protocol.replay import REPLAY_WINDOW
from ..protocol.sender import StartWrite
from ..protocol.tp import owed_heads
from ..protocol.wire import Registration
from ..transport.base import Transport
from .armed import ArmedStore, ArmedWrite
from .base import TransferHooks
from .peers import DecodePeer, DecodePeers, Prepared
from .posting import MadeWrite, WriteSpec, discard, write_spec
from .push_request import PushRequest

log = logging.getLogger("kvpush")

Plan = TransferPlan | IndexPlan


class WriteMaker:
    """StartWrite + peer -> a WRITE ready to post; Arm -> the same WRITE made ahead and kept unposted."""

    def __init__(
        self,
        layout: KVLayout,
        mem_type: str,
        transport: Transport,
        peers: DecodePeers,
        armed: ArmedStore,
        hooks: TransferHooks | None,
    ) -> None:
        self.layout, self.mem_type, self.transport = layout, mem_type, transport
        self.peers, self.armed, self.hooks = peers, armed, hooks
        self.last_units: PairUnits | None = None  # the pair the last WRITE used: prefill_done plans for it

    def make(self, act: StartWrite, req: PushRequest) -> tuple[Plan, WriteSpec]:
        """act's WRITE: planned (req's plan_built mark) and sealed (its sealed mark), after the source is
        ready. LayoutError if the blocks do not fit; TransportError (PeerGone) if it cannot go."""
        peer, session = self.peers.route((act.decode_engine_id, act.decode_rank))
        self.source_ready(act, req)
        prep = self.peers.prepared(peer, act.heads)
        plan = self._plan(act, req, peer, prep)
        req.marks.setdefault("plan_built", time.monotonic())
        notif = sealed_done(act, self.layout.rank, plan.nbytes, session)
        spec = write_spec(plan, notif, peer.agent, self.mem_type, prep)
        req.marks.setdefault("sealed", time.monotonic())
        return plan, spec

    def take_made(self, act: StartWrite, req: PushRequest, now: float) -> ArmedWrite | None:
        """The WRITE made ahead for exactly this StartWrite (None: there is none), its source made ready;
        made anew if its peer's session changed since (or the decode's replay window would refuse its
        notification). LayoutError/TransportError as `make`."""
        made = self.armed.take(act) if self.armed else None
        if made is None:
            return None
        peer = self.peers.get((act.decode_engine_id, act.decode_rank))
        session = None if peer is None else peer.session
        if session is not made.session or session.sealed(NOTIF) - made.seq >= REPLAY_WINDOW // 2:
            discard(self.transport, made.spec)
            again = self._make_ahead(act, req, True, now)
            if again is None:
                raise TransportError("the decode's prepared lists are gone")
            return again
        if req.barriers:
            try:
                self.source_ready(act, req)
            except TransportError:
                discard(self.transport, made.spec)
                raise
        return made

    def arm(self, act: StartWrite, req: PushRequest | None) -> None:
        """The machine's Arm: plan, seal and make act's WRITE now, before prefill_done, and keep it
        unposted (armed.py). Not with staging hooks (they copy the blocks only once prefill_done came)
        nor for a pair without prepared lists; any failure leaves the general path to prefill_done."""
        if self.hooks is not None:
            return
        try:
            made = self._make_ahead(act, req, False, time.monotonic())
        except (LayoutError, TransportError) as exc:
            log.debug("kvpush push %s: not made ahead: %s", act.request_id, exc)
            return
        if made is not None:
            self.armed.put((act.request_id, act.attempt, act.decode_rank), made)

    def _make_ahead(
        self, act: StartWrite, req: PushRequest | None, ready: bool, now: float
    ) -> ArmedWrite | None:
        peer, session = self.peers.route((act.decode_engine_id, act.decode_rank))
        if ready and req is not None:
            self.source_ready(act, req)
        prep = self.peers.prepared(peer, act.heads)
        plan = self._plan(act, req, peer, prep)
        if prep is None or not isinstance(plan, IndexPlan):
            return None
        notif = sealed_done(act, self.layout.rank, plan.nbytes, session)
        handle = self.transport.make_write(prep.local, plan.src_idx, prep.remote, plan.dst_idx, notif)
        return ArmedWrite(act, plan, MadeWrite(handle), session, session.sealed(NOTIF), now)

    def _plan(
        self, act: StartWrite, req: PushRequest | None, peer: DecodePeer, prep: Prepared | None
    ) -> Plan:
        """Indices into the pair's prepared lists (with the sides planned before the trigger, for a whole
        request), else fresh descriptor lists."""
        if prep is None:
            return write_plan(act, self.layout, peer.layout, None)
        self.last_units = prep.units
        if req is not None and not act.token_start and act.layers is None:
            src = req.src_half
            dst = None if req.dst_half is None else req.dst_half.get((act.attempt, act.decode_rank))
            if src is not None or dst is not None:
                return build_index_plan(
                    prep.units, act.src_blocks, act.dst_blocks, act.num_tokens, halves=(src, dst)
                )
        return write_plan(act, self.layout, peer.layout, prep.units)

    def plan_source(self, req: PushRequest, blocks: BlockIds, num_tokens: int) -> None:
        """prefill_done before any registration: plan the source side now, for the pair the last WRITE
        used (a prefill usually serves one decode layout); the registration then plans only its side."""
        if self.last_units is None:
            return
        try:
            half = half_plan(self.last_units, False, blocks, num_tokens)
        except LayoutError:  # the plan at the trigger says it again, for this request alone
            return
        if half is not None:
            req.src_half = half

    def plan_destination(self, req: PushRequest, reg: Registration) -> None:
        """A registration waiting for prefill_done: plan its side now (the pair's prepared lists are made
        here if this is its first request); prefill_done then plans only the source side."""
        peer = self.peers.get((reg.decode_engine_id, reg.decode_rank))
        lay = self.layout
        heads = owed_heads(lay.tp_rank, lay.tp_size, reg.decode_tp, lay.total_kv_heads).get(reg.decode_rank)
        prep = None if heads is None or peer is None else self.peers.prepared(peer, heads)
        try:
            half = None if prep is None else half_plan(prep.units, True, reg.tables(), reg.num_tokens)
        except LayoutError:
            return
        if half is not None:
            if req.dst_half is None:
                req.dst_half = {}
            req.dst_half[(reg.attempt, reg.decode_rank)] = half

    def source_ready(self, act: StartWrite, req: PushRequest) -> None:
        """Before the first WRITE from a request's blocks: wait for the engine's "KV written" barriers
        (a device event, say) and let the backend stage the blocks; both run here, on the push thread."""
        barriers, req.barriers = req.barriers, None
        for barrier in barriers or ():  # every range reported so far: all in order
            try:
                barrier()
            except Exception as exc:  # a failed barrier fails this request, not the thread
                raise TransportError(f"the engine's KV-written barrier failed: {exc!r}") from exc
        if self.hooks is not None and not req.staged:
            try:
                self.hooks.before_write(act.request_id, act.src_blocks)
            except Exception as exc:  # likewise: the request fails with the reason
                raise TransportError(f"staging the source blocks failed: {exc!r}") from exc
            req.staged = True
