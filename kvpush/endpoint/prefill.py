"""The prefill endpoint: receives registrations, pushes KV with WRITEs, tells the engine when blocks are free.

    prefill = PrefillEndpoint(config, layout)          # layout placed in registered memory
    prefill.start()                                     # transport, side channel on config.side_channel.host:port+rank
    prefill.prefill_done(req_id, block_ids, num_tokens) # returns at once
    for r in prefill.finished(): free(r.block_ids)      # WRITEs completed (or the request failed)

Every call checks its arguments on the engine's thread and hands a command to the push thread
(push_thread.py), which does the rest; a prefill_done whose WRITEs were made ahead and are small may post
them from the engine's thread instead (loop.run_inline). What a call keeps for a later one (source_blocks'
checked table, whether kv_ready streams) is the push thread's `engine` (push_request.EngineSide).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import KVPushConfig
from ..errors import LayoutError
from ..protocol.groups import TableArg
from ..protocol.layout import KVLayout
from .base import (
    TIMELINE,
    Endpoint,
    EndpointCore,
    SendResult,
    TransferHooks,
    TransportSource,
    checked_blocks,
    stream_table,
)
from .control import ControlPlane
from .early import ReadyCall
from .loop import TransferLoop
from .prefill_conns import MAX_MESSAGES_PER_ROUND
from .push_thread import PushThread
from .stats import Count

__all__ = ["MAX_MESSAGES_PER_ROUND", "TIMELINE", "PrefillEndpoint", "PushThread"]


class PrefillEndpoint(Endpoint[SendResult]):
    """One prefill rank: receives registrations, pushes KV, tells the engine when blocks are free."""

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str = "DRAM",
        transport: TransportSource = None,
        control: ControlPlane | None = None,
        hooks: TransferHooks | None = None,
    ) -> None:
        core = EndpointCore[SendResult](config, "prefill", layout, mem_type, transport, control)
        loop: TransferLoop[PushThread] = TransferLoop(
            config.pacing, lambda loop: PushThread(core, loop, hooks)
        )
        self._push = loop.role
        super().__init__(config, layout, core, loop)
        self._engine = self._push.engine  # per request, what one engine call keeps for a later one

    @property
    def address(self) -> tuple[str, int]:
        """(host, base port): decode ranks reach rank r at base port + r."""
        return self.config.side_channel.advertised, self._push.bound_port - self.layout.rank

    def prefill_done(
        self,
        request_id: str,
        block_ids: TableArg,
        num_tokens: int,
        kv_written: Callable[[], None] | None = None,
        decode_engine_id: str = "",
    ) -> None:
        """The request's prompt KV is computed into block_ids (one table, or one per KV-cache group of
        the layout; a window group's may hold -1 outside the window); push it once decode has registered.

        kv_written: optional barrier the push thread calls before reading the blocks (e.g. a CUDA event's
        synchronize, recorded by the engine on the stream that wrote the KV): the engine never waits.
        decode_engine_id: the decode engine the router sent this request to, when known: only that engine
        may then register for it or abort it (otherwise the first engine to register owns it).
        """
        at = time.monotonic()
        engine = self._engine
        named = engine.sourced.pop(request_id, None) if engine.sourced else None
        if named is not None and named[0] == num_tokens and tuple(block_ids) == named[1]:
            blocks = named[1]  # checked at source_blocks (a flat table compares equal only to itself)
        else:
            blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens)
        if engine.streaming:
            engine.streaming.discard(request_id)
        push, loop = self._push, self._loop

        def command() -> None:
            push.cmd_prefill_done(request_id, blocks, num_tokens, at, kv_written, decode_engine_id)

        def on_engine_thread() -> None:
            command()
            push.ledger.add(Count.ENGINE_POSTS)  # under the thread's round lock: the ledger's one writer

        if kv_written is None and loop.run_inline(on_engine_thread, lambda: push.inline_ok(request_id)):
            return  # posted from this thread: the WRITE was made ahead (source_blocks) and is small
        loop.submit(command)

    def source_blocks(
        self,
        request_id: str,
        block_ids: TableArg,
        num_tokens: int,
        decode_engine_id: str = "",
    ) -> None:
        """The engine is computing the prompt's KV into block_ids (as prefill_done will name them: one
        table, or one per KV-cache group) and prefill_done follows; vLLM could say so during the forward
        pass. A registered decode rank's WRITE is then planned, sealed and made now, so prefill_done with
        the same blocks and tokens only posts it. Optional and non-blocking; the blocks stay the engine's
        (nothing reads them before prefill_done), and a request that never gets its prefill_done ends
        when its lease runs out. Other blocks at prefill_done, kv_ready ranges, an abort or expiry drop
        what was made and take the general path. decode_engine_id: as in prefill_done.
        """
        blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens)
        if self._push.hooks is None:  # staging makes nothing ahead: prefill_done checks its table again
            # dropped by prefill_done or abort, or by the push thread with the request (push_request.py)
            self._engine.sourced[request_id] = (num_tokens, blocks)
        self._loop.submit(
            lambda: self._push.cmd_source_blocks(request_id, blocks, num_tokens, decode_engine_id)
        )

    def kv_ready(
        self,
        request_id: str,
        block_ids: TableArg,
        num_tokens: int,
        layers: tuple[int, int] | None = None,
        kv_written: Callable[[], None] | None = None,
        decode_engine_id: str = "",
    ) -> None:
        """Streamed push: the first `num_tokens` tokens of layers [layers[0], layers[1]) (None: all) are
        computed into block_ids (a prefix of the table prefill_done will give). Their WRITEs may start now;
        prefill_done stays the terminal call, after abort() too: from the first kv_ready the blocks are
        the endpoint's until its SendResult, which only prefill_done brings. kv_written: this range's
        barrier, as in prefill_done; every barrier reported so far is called before a WRITE reads them. Below
        stream_min_tokens nothing can move yet: the call waits here for the request's next one (early.py).
        """
        blocks = stream_table(self.layout, request_id, block_ids, num_tokens)
        if layers is not None and not (0 <= layers[0] < layers[1] <= self.layout.num_layers):
            raise LayoutError(f"kv_ready {request_id!r}: layers {layers} outside 0..{self.layout.num_layers}")
        call, push = ReadyCall(blocks, num_tokens, layers, kv_written, decode_engine_id), self._push
        streaming = self._engine.streaming
        if request_id not in streaming and (
            num_tokens < self.config.streaming.min_tokens or push.hooks is not None
        ):
            self._loop.alive_or_raise()
            push.early.hold(request_id, call, time.monotonic())  # nothing may move yet: early.py
            return
        streaming.add(request_id)  # before the command: the push thread drops it with the request
        try:
            self._loop.submit(lambda: push.cmd_held(request_id, [*push.early.take(request_id), call]))
        except BaseException:
            streaming.discard(request_id)
            raise

    def abort(self, request_id: str, reason: str = "aborted by prefill engine") -> None:
        self._engine.drop(request_id)
        self._loop.submit(lambda: self._push.cmd_abort(request_id, reason))
