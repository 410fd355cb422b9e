"""What the prefill and decode endpoints share: results, addresses, the rank's transport, the ledger,
the public lifecycle (start, close, sticky death) and the engine-call argument checks."""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from ..config import KVPushConfig
from ..errors import LayoutError, RequestError, WireError
from ..protocol.groups import (
    BlockIds,
    Table,
    TableArg,
    as_block_ids,
    check_group_tables,
    flat_ids,
    single_table,
)
from ..protocol.handshake import make_hello
from ..protocol.layout import KVLayout
from ..protocol.prepared import plain_table
from ..protocol.ranges import StreamPolicy
from ..protocol.reasons import Failure
from ..protocol.wire import Codec, Hello, Message, request_problem
from ..transport.base import Transport
from ..transport.nixl import NixlTransport, prepare_environment
from .control import ControlPlane, ZmqControl
from .loop import LoopRole, TransferLoop
from .stats import Count, Ledger, serve_metrics

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from 3.11; annotations only

log = logging.getLogger("kvpush")


# The per-request timeline (monotonic seconds), in SendResult.timeline and the DEBUG log, in order:
# registered, prefill_done (the engine's call; the later of the two is the trigger), picked (the push
# thread began the StartWrite: the wake-up and the machine are behind it), plan_built (the plan),
# sealed (its TransferDone sealed), queued (in the WRITE scheduler), made (the transfer was made and its
# post began; on UCX loopback the copy runs inside the post, so posted - made is the copy and
# trigger -> made is kvpush's per-WRITE cost without it), posted, complete (the poll that saw DONE; with
# UCX the WRITE's notification leaves inside that call, so it is also when the notification was sent).
TIMELINE = (
    "registered", "prefill_done", "picked", "plan_built", "sealed", "queued", "made", "posted", "complete"
)  # fmt: skip


@dataclass(frozen=True)
class PrefillAddress:
    """Where a decode engine finds the prefill engine (as a router passes it along)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    def rank_port(self, rank: int) -> int:
        return self.port + rank


@dataclass(frozen=True)
class SendResult:
    request_id: str
    ok: bool
    block_ids: BlockIds  # as prefill_done was given them (one table, or one per KV-cache group)
    reason: str = ""
    nbytes: int = 0
    done_at: float = 0.0
    # monotonic marks of this request on the push thread (see TIMELINE)
    timeline: dict[str, float] = field(default_factory=dict, compare=False)
    failure: Failure | None = None  # why it failed, as a kind (reason says it in words); None when ok


@dataclass(frozen=True)
class RecvResult:
    request_id: str
    ok: bool
    block_ids: BlockIds  # as expect() was given them (one table, or one per KV-cache group)
    reason: str = ""
    nbytes: int = 0
    ready_at: float = 0.0
    failure: Failure | None = None  # why it failed, as a kind (reason says it in words); None when ok


def new_nixl_transport(config: KVPushConfig, role: str, rank: int, mem_type: str = "DRAM") -> Transport:
    """A NIXL agent with exactly the configured backends, each checked to support `mem_type` (the memory
    this endpoint registers): a missing LIBFABRIC or a backend without VRAM fails here, by name."""
    prepare_environment(config.nixl.ucx_net_devices)
    return NixlTransport(
        f"{config.engine_id}-{role}-{rank}-{uuid.uuid4().hex[:8]}",
        config.nixl.backends,
        backend_params=config.nixl.backend_params,
        mem_types=(mem_type,),
    )


class TransferHooks(Protocol):
    """Where a memory backend joins the data path, on the transfer thread (never the engine's).

    Host staging for a device cache uses both: the registered (and planned) memory is a host bounce
    buffer; `before_write` copies the request's blocks device -> host before the WRITE is posted, and
    `after_receive` copies them host -> device before the request is reported ready.
    """

    def before_write(self, request_id: str, block_ids: BlockIds) -> None: ...
    def after_receive(self, request_id: str, block_ids: BlockIds) -> None: ...


R = TypeVar("R", SendResult, RecvResult)

# What an endpoint gets its transport from: None (a NIXL agent from the config), a transport, or a
# factory called on the transfer thread at start (so the agent is created on the thread that drives it).
TransportSource = Transport | Callable[[], Transport] | None


class EndpointRole(LoopRole, Protocol):
    """A role as its endpoint sees it, besides the loop's hooks."""

    def tracked(self) -> int:
        """Requests the role's state machine still tracks (leases and timeouts need ticks)."""

    def kept(self) -> dict[str, int]:
        """What the role keeps per request, by map (kept.py): all 0 at rest."""

    def describe(self, request_id: str) -> str:
        """Where the role's state machine stands on request_id, in words, for a log line about a request
        held too long. Called from the engine thread: the roles read with single lookups (racy, never
        raising), so the answer may be a moment old."""


class EndpointCore(Generic[R]):
    """What a rank's role shares with its endpoint: the transport (created and registered on the loop's
    thread at setup), codec, instance, ledger, ticks and the queue of results the engine drains."""

    def __init__(
        self,
        config: KVPushConfig,
        role: str,
        layout: KVLayout,
        mem_type: str,
        transport: TransportSource,
        control: ControlPlane | None,
    ) -> None:
        self.config = config
        self.role = role
        self.layout = layout
        self.mem_type = mem_type
        self.codec = Codec(config.limits.max_message_bytes)
        self.instance = os.urandom(16)  # new per start of this process's endpoint: peers spot a restart
        self.control: ControlPlane = control if control is not None else ZmqControl()
        self._transport_source = transport
        self._next_tick = 0.0
        self.ledger = Ledger(role, config.engine_id, layout.rank)
        # None, last: the thread ended and every result it reported on the way down is in the queue
        self.results: queue.SimpleQueue[R | None] = queue.SimpleQueue()
        self.reported_all = False
        self.result_event = threading.Event()
        self.result_listener: Callable[[], None] | None = None

    def setup_transport(self) -> tuple[Transport, Hello]:
        src = self._transport_source
        if src is None:
            transport = new_nixl_transport(self.config, self.role, self.layout.rank, self.mem_type)
        elif isinstance(src, Transport):
            transport = src
        else:
            transport = src()
        transport.register(self.layout.regions, self.mem_type)
        hello = make_hello(
            self.config.engine_id,
            self.role,
            transport.name,
            transport.metadata(),
            self.mem_type,
            self.layout,
            instance=self.instance,
            auth=self.config.security.hmac_key is not None,
        )
        return transport, hello

    def tick_due(self, now: float) -> bool:
        if now < self._next_tick:
            return False
        self._next_tick = now + self.config.pacing.idle_poll_s / 2
        return True

    def wound_down(self) -> None:
        """The loop's thread ended: every result it reported is in the queue."""
        self.results.put(None)
        self.result_event.set()

    def put_result(self, result: R) -> None:
        self.results.put(result)
        self.result_event.set()
        listener = self.result_listener
        if listener is None:
            return
        try:
            listener()
        except Exception:
            log.exception("kvpush: result listener failed")

    def decode_or_count(
        self, data: bytes | None, origin: str, opener: Callable[[bytes], Message] | None = None
    ) -> Message | None:
        """Open one frame (opener: a session's, or a Hello's); a bad one is counted and logged (the peer's
        name escaped), never raised into the loop."""
        try:
            if data is None:
                raise WireError("malformed frame (wrong number of parts or over the size limit)")
            return (opener or self.codec.decode)(data)
        except WireError as exc:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush: dropped a message from %s: %s", ascii(origin), exc)
            return None


class Endpoint(Generic[R]):
    """The engine-facing half: lifecycle, results, stats. Every call returns at once."""

    def __init__(
        self, config: KVPushConfig, layout: KVLayout, core: EndpointCore[R], loop: TransferLoop[EndpointRole]
    ) -> None:
        if not layout.regions:
            raise LayoutError(f"{type(self).__name__} needs a layout placed in memory (regions and planes)")
        self.config = config
        self.layout = layout
        self._core: EndpointCore[R] = core
        self._loop = loop
        self._role: EndpointRole = loop.role

    def start(self) -> None:
        """Start the transfer thread (its transport and side channel) and the metrics endpoint. A start
        that fails part way stops what it started, so `with Endpoint(...)` leaks nothing either (its
        __exit__ never runs when __enter__ raises)."""
        self._loop.start()
        try:
            if self.config.metrics.port is not None:
                # one port per rank (PP stage x TP), as for the side channel: ranks must not collide
                serve_metrics(self.config.metrics.host, self.config.metrics.port + self.layout.rank)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the transfer thread. Live requests are reported as failed; finished() hands them out,
        then raises EndpointClosed."""
        self._loop.stop()

    @property
    def closed(self) -> bool:
        return self._loop.closed or self._loop.fatal is not None

    def set_result_listener(self, listener: Callable[[], None] | None) -> None:
        """Call `listener()` (on the transfer thread, so it must be quick and must not block) whenever a
        result becomes available to `finished()`. An engine that sleeps while it has nothing to compute
        uses it to wake up as soon as a transfer settles instead of polling."""
        self._core.result_listener = listener

    def finished(self) -> list[R]:
        """Results since the last call. Once the endpoint is closed or its thread died, the results it
        reported on the way down are still handed out; after that, EndpointClosed."""
        c = self._core
        c.result_event.clear()
        got = _drain(c.results)
        out = [r for r in got if r is not None]
        c.reported_all = c.reported_all or len(out) < len(got)
        if not out and (self._loop.fatal is None or c.reported_all):
            # a dead thread's teardown may still be reporting: raise only once all of it was handed out
            self._loop.alive_or_raise()
        return out

    def wait_any(self, timeout: float) -> list[R]:
        got = self.finished()
        if got:
            return got
        self._core.result_event.wait(timeout)
        return self.finished()

    def describe(self, request_id: str) -> str:
        """Where the transfer thread's state machine stands on request_id, in words (for logs)."""
        return self._role.describe(request_id)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = self._core.ledger.snapshot()
        out["pending"] = self._role.tracked()  # a racy read is fine for a gauge
        return out

    def pending(self) -> int:
        """Requests the state machine still tracks (asked on the transfer thread)."""
        return int(self._loop.call(self._role.tracked, self.config.liveness.handshake_timeout_s))

    def kept_state(self) -> dict[str, int]:
        """What the transfer thread keeps per request, map by map (asked on that thread): every count is
        0 once nothing is pending and the leases have run out; anything else is a leak (kept.py)."""
        return dict(self._loop.call(self._role.kept, self.config.liveness.handshake_timeout_s))


def checked_blocks(
    layout: KVLayout,
    request_id: str,
    block_ids: TableArg,
    num_tokens: int,
    max_message_bytes: int | None = None,
) -> BlockIds:
    """The caller's block table (or one per KV-cache group), or an error naming what is wrong (caught
    here, not on the wire, where it would surface only as a timeout). max_message_bytes: also bound the
    registration this table makes."""
    if not request_id:
        raise RequestError("request_id must be a non-empty string")
    if num_tokens <= 0:
        raise RequestError(f"{request_id}: num_tokens must be > 0, got {num_tokens}")
    plain = plain_table(layout, block_ids, num_tokens)
    blocks: BlockIds = as_block_ids(block_ids) if plain is None else plain
    if plain is None:
        check_group_tables(layout, blocks, num_tokens, request_id)
    problem = request_problem(request_id, flat_ids(blocks)[0], num_tokens, max_message_bytes)
    if problem:
        raise RequestError(f"{request_id[:64]!r}: {problem}")
    return blocks


def stream_table(layout: KVLayout, request_id: str, block_ids: TableArg, num_tokens: int) -> Table:
    """kv_ready's table, checked as `checked_blocks` does: streamed ranges move one full-attention KV-cache
    group (a window group's oldest blocks leave the table as the prompt grows; several groups are planned
    per group), so any other layout is refused by name and moves in one piece at prefill_done."""
    if layout.num_groups != 1 or layout.window(0):
        raise LayoutError(
            f"kv_ready {request_id!r}: streamed ranges move one full-attention KV-cache group; this layout "
            f"has {layout.num_groups} group(s), windows {layout.group_window}: call prefill_done alone"
        )
    table = single_table(checked_blocks(layout, request_id, block_ids, num_tokens))
    assert table is not None  # one group (checked above)
    return table


def _drain(q: queue.SimpleQueue[R | None]) -> list[R | None]:
    out: list[R | None] = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def stream_policy(config: KVPushConfig, layout: KVLayout) -> StreamPolicy:
    """The streaming thresholds, with this rank's bytes per token per layer to size a range by."""
    per_token_layer = layout.kv_per_layer * layout.num_kv_heads * layout.unit_bytes
    s = config.streaming
    return StreamPolicy(s.min_tokens, s.min_bytes, per_token_layer)
