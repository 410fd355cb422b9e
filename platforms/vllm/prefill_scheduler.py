"""The prefill engine's scheduler side (kv_producer).

* update_state_after_alloc: a `do_remote_decode` request claims its transfer key (or is refused).
* build_connector_meta: a request whose prompt completes in this step is listed in this step's metadata;
  the worker hands it to the push thread in wait_for_save(), right after the forward pass that wrote the
  last KV, not one engine step later.
* request_finished: delay freeing; the worker reports finished_sending once the WRITE completed (or
  failed, or was aborted).

The prompt's block ids come from a `BlockIdSource`: by default the scheduler's own `BlockTable`, fed from
each step's scheduler output (every vLLM version); the facade puts the KV cache manager that vLLM >= 0.32
binds in front of it (`block_table.manager_or_table`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush.protocol.layout import blocks_for

from .block_table import BlockIdSource, BlockTable, group_ids
from .params import ConnectorSettings, KVTransferParams, transfer_key
from .scheduler import KVPushConnectorMetadata, SchedulerBase, SendItem, cut_prompt

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.vllm")


class SendState(enum.Enum):
    COMPUTING = "computing"  # the prompt is being computed
    HANDED = "handed"  # in this or an earlier step's metadata: the push thread owns the blocks
    SENDING = "sending"  # finished in vLLM; blocks held until the worker reports finished_sending
    REFUSED = "refused"  # its transfer key is taken by a live request: never handed, freed at once


@dataclass
class _PrefillRequest:
    request: Request
    key: str
    state: SendState
    reason: str = ""
    decode_engine_id: str = ""  # the decode the router named: the only one the push may go to
    streamed: int = 0  # tokens reported ready (kv_ready) so far; > 0: the push thread may read its blocks
    stream_off: bool = False  # preempted mid-stream: its push is aborted, nothing more is reported


class PrefillScheduler(SchedulerBase):
    """Which prompts to push in which step, and how long vLLM keeps their blocks."""

    def __init__(
        self, settings: ConnectorSettings, block_ids: BlockIdSource | None = None, backoff: int = 0
    ) -> None:
        super().__init__(settings)
        self.backoff = backoff  # prompt tokens left for the decode to compute (window_backoff)
        self.table = BlockTable()  # fed every step; read where no other source answers
        self.block_ids: BlockIdSource = block_ids or self.table.block_ids
        self.prefills: dict[str, _PrefillRequest] = {}  # by vLLM request id

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # a prefill computes its prompts itself

    def on_new_request(self, request: Request) -> None:
        """With a backoff (sliding-window groups, see window_backoff): a request whose KV is pushed
        computes all of its prompt but the last `backoff` tokens, which the decode computes. Done once,
        when vLLM adds the request (a preempted request is not cut again)."""
        params = self._params(request)
        if not self.backoff or params is None or not params.do_remote_decode:
            return
        cut_prompt(request, self.backoff)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        rid = request.request_id
        if params is None or not params.do_remote_decode or rid in self.prefills:
            return
        key = transfer_key(rid, params)
        reason = self._claim(key, rid)
        if reason:
            log.warning("kvpush: prefill request %s will not push its KV: %s", rid, reason)
        self.prefills[rid] = _PrefillRequest(
            request,
            key,
            SendState.REFUSED if reason else SendState.COMPUTING,
            reason,
            params.decode_engine_id or "",
        )

    def _add_to_step(self, scheduler_output: SchedulerOutput, meta: KVPushConnectorMetadata) -> None:
        """Hand over every prompt whose last tokens this step computes."""
        if not self.prefills:
            return
        computing = {rid for rid, rec in self.prefills.items() if rec.state is SendState.COMPUTING}
        self.table.update(scheduler_output, computing)
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            rec = self.prefills.get(rid)
            if rec is None or rec.state is not SendState.COMPUTING:
                continue
            req = rec.request
            done = int(req.num_computed_tokens + n)
            if rec.streamed and not rec.stream_off and req.num_computed_tokens < rec.streamed:
                self._preempted(rid, rec, meta)  # vLLM freed and reallocated its blocks: stop reading them
            if done < req.num_prompt_tokens:
                if self.settings.stream and not rec.stream_off and done > rec.streamed:
                    ready = group_ids(self.block_ids(rid), blocks_for(done, self.settings.block_size))
                    if ready and isinstance(ready[0], int):  # streamed ranges move one KV-cache group
                        meta.ready.append(SendItem(rid, rec.key, ready, done, rec.decode_engine_id))
                        rec.streamed = done
                continue  # a chunk; the prompt completes in a later step
            num_tokens = int(req.num_prompt_tokens)
            blocks = group_ids(self.block_ids(rid), blocks_for(num_tokens, self.settings.block_size))
            meta.send.append(SendItem(rid, rec.key, blocks, num_tokens, rec.decode_engine_id))
            rec.state = SendState.HANDED
            self.table.drop(rid)

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks?, kv_transfer_params for the decode): held only while a push may read them."""
        rid = request.request_id
        rec = self.prefills.get(rid)
        if rec is None:
            self._abort_unallocated(request)
            return False, None
        if rec.state is SendState.REFUSED:
            del self.prefills[rid]  # its key belongs to another live request: nothing of ours to abort
            return False, None
        if rec.state is SendState.COMPUTING and rec.streamed:
            held = list(block_ids[0]) if block_ids else []
            return self._stop_stream(rid, rec, held), None  # ranges may be in flight: held until settled
        if rec.state is SendState.COMPUTING:
            self._abort_before_hand_over(rid, rec)
            return False, None
        return True, self._hold_while_sending(request, rec)

    def _abort_unallocated(self, request: Request) -> None:
        """Dropped before its blocks were allocated: a decode that registered already is told now."""
        params = self._params(request)
        if params is not None and params.do_remote_decode:
            key = transfer_key(request.request_id, params)
            if self._key_is_free(key):
                self.meta.abort_send.append((request.request_id, key))

    def _abort_before_hand_over(self, rid: str, rec: _PrefillRequest) -> None:
        """Aborted before its prompt completed: a decode that registered already is told at once instead
        of waiting for the lease to run out."""
        del self.prefills[rid]
        self.table.drop(rid)
        self._release(rec.key, rid)
        self.meta.abort_send.append((rid, rec.key))

    def _stop_stream(self, rid: str, rec: _PrefillRequest, blocks: list[int]) -> bool:
        """Aborted mid-stream: the push is aborted, then ended by its terminal prefill_done on the blocks
        it holds now (`blocks`, what vLLM says it holds); vLLM keeps them until the worker reports
        finished_sending (every WRITE settled). False when it holds none (preempted, not rescheduled)."""
        self.table.drop(rid)
        n = min(rec.streamed, len(blocks) * self.settings.block_size)
        if n <= 0:
            self._abort_before_hand_over(rid, rec)
            return False
        self.meta.abort_send.append((rid, rec.key))
        self.meta.stop.append(
            SendItem(
                rid,
                rec.key,
                tuple(blocks[: blocks_for(n, self.settings.block_size)]),
                n,
                rec.decode_engine_id,
            )
        )
        rec.state = SendState.SENDING
        return True

    def _preempted(self, rid: str, rec: _PrefillRequest, meta: KVPushConnectorMetadata) -> None:
        """Preempted mid-stream (vLLM freed its blocks): the push is aborted before anything else is
        handed over, so the decode is told it failed and nothing read from the freed blocks counts. The
        request still completes here and ends its push with prefill_done, which then fails."""
        log.warning("kvpush: prefill request %s was preempted mid-stream: its push is aborted", rid)
        meta.abort_send.append((rid, rec.key))  # the worker aborts before it hands anything over
        rec.stream_off = True

    def _hold_while_sending(self, request: Request, rec: _PrefillRequest) -> dict[str, Any]:
        """Handed over: its blocks stay until the worker reports finished_sending. A request that did not
        finish normally (aborted) aborts its push. Returns what the router passes to the decode."""
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self.meta.abort_send.append((request.request_id, rec.key))
        rec.state = SendState.SENDING
        cfg = self.settings.config
        return KVTransferParams(
            do_remote_prefill=True,
            transfer_mode="push",
            remote_engine_id=cfg.engine_id,
            remote_request_id=rec.key,
            remote_host=cfg.side_channel.advertised,
            remote_port=cfg.side_channel.port,
            tp_size=self.settings.tp_size,
            pp_size=self.settings.pp_size,
        ).to_dict()

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_sending or ():
            rec = self.prefills.pop(rid, None)
            if rec is not None:
                self._release(rec.key, rid)

    def _holding_blocks(self) -> bool:
        return any(r.state in (SendState.HANDED, SendState.SENDING) for r in self.prefills.values())

    def _awaiting_transfers(self) -> bool:
        return self._holding_blocks()
