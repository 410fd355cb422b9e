"""The scheduler side of KVPushConnector: what vLLM's scheduler asks, per step, and the step metadata.

Decode (kv_consumer):
  * get_num_new_matched_tokens: a request with `do_remote_prefill` will receive its whole prompt's KV.
  * update_state_after_alloc: the blocks are allocated; they go into this step's metadata and the worker
    calls DecodeEndpoint.expect() at the start of the same step (the registration leaves at once).
  * a request aborted while waiting keeps its blocks until the endpoint says no WRITE can still land.

Prefill (kv_producer):
  * build_connector_meta: a `do_remote_decode` request whose prompt completes in this step is listed in
    this step's metadata; the worker hands it to the push thread in wait_for_save(), right after the
    forward pass that wrote the last KV, not one engine step later.
  * request_finished: delay freeing; the worker reports finished_sending once the WRITE completed (or
    failed, or was aborted).

Transfer keys are unique among live requests on each side: a request whose key is already taken by a
live one (a client reusing X-Request-Id without a router's transfer_id) is refused with a reason and its
blocks released, instead of silently replacing the first one in the endpoint.
"""

from __future__ import annotations

import atexit
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import ConnectorSettings, KVTransferParams, transfer_key
from .wake import IdleWaiter

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.vllm")


@dataclass(frozen=True)
class RecvItem:
    """Decode: register these blocks for this request's KV (worker calls DecodeEndpoint.expect)."""

    req_id: str  # vLLM's internal id
    key: str
    block_ids: tuple[int, ...]
    num_tokens: int
    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int


@dataclass(frozen=True)
class CancelItem:
    """Decode: a request dropped before allocation; the prefill may hold KV for it, so tell it."""

    key: str
    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int


@dataclass(frozen=True)
class SendItem:
    """Prefill: this request's prompt KV is computed by this step's forward pass; push it."""

    req_id: str
    key: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class KVPushConnectorMetadata(KVConnectorMetadata):
    expect: list[RecvItem] = field(default_factory=list)
    fail_recv: list[tuple[str, str]] = field(default_factory=list)  # (req_id, reason)
    abort_recv: list[str] = field(default_factory=list)
    cancel_recv: list[CancelItem] = field(default_factory=list)
    send: list[SendItem] = field(default_factory=list)
    abort_send: list[tuple[str, str]] = field(default_factory=list)  # (req_id, key)
    wake_path: str = ""  # the scheduler's IdleWaiter; workers wake it when a transfer settles

    def has_commands(self) -> bool:
        return bool(
            self.expect
            or self.fail_recv
            or self.abort_recv
            or self.cancel_recv
            or self.send
            or self.abort_send
        )


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


class SchedulerSide:
    """Both roles' scheduler logic; `role` comes from kv_role (kv_both is refused by the facade)."""

    def __init__(self, settings: ConnectorSettings, kv_cache_manager: Callable[[], Any]) -> None:
        self.settings = settings
        self.is_producer = settings.is_producer
        self.meta = KVPushConnectorMetadata()
        self.prefills: dict[str, _PrefillRequest] = {}  # P: by vLLM request id
        self.recving: dict[str, str] = {}  # D: request id -> its transfer key ("" if it has none)
        self.live_keys: dict[str, str] = {}  # transfer key -> the live request id that owns it
        self.kv_cache_manager = kv_cache_manager  # vLLM binds it after constructing the connector
        self.waiter: IdleWaiter | None = None
        if settings.idle_wait_s > 0:
            self.waiter = IdleWaiter()
            atexit.register(self.waiter.close)

    @staticmethod
    def _params(request: Request) -> KVTransferParams | None:
        raw = request.kv_transfer_params
        if not raw:
            return None
        try:
            return KVTransferParams.from_dict(raw)
        except ValueError as exc:
            log.warning("kvpush: request %s: %s; serving it without KV transfer", request.request_id, exc)
            return None

    def _claim(self, key: str, rid: str) -> str:
        """Take the transfer key for rid, or return why not (another live request holds it)."""
        owner = self.live_keys.get(key)
        if owner is not None and owner != rid:
            return (
                f"transfer key {key!r} is already used by live request {owner!r} (two requests with the "
                "same X-Request-Id and no transfer_id; route through `kvpush proxy` or send unique ids)"
            )
        self.live_keys[key] = rid
        return ""

    def _release(self, key: str, rid: str) -> None:
        if self.live_keys.get(key) == rid:
            del self.live_keys[key]

    # ---- decode ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self._params(request)
        if params is None or not params.do_remote_prefill or self.is_producer:
            return 0, False
        if num_computed_tokens:
            # A local prefix hit: kvpush writes whole prompts, never into cached (shared) blocks.
            log.warning(
                "kvpush: request %s has a local prefix hit of %d tokens; computing it locally "
                "(disable prefix caching on decode for P/D)",
                request.request_id,
                num_computed_tokens,
            )
            return 0, False
        n = int(request.num_prompt_tokens)
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        if params is None:
            return
        rid = request.request_id
        if self.is_producer:
            if params.do_remote_decode and rid not in self.prefills:
                key = transfer_key(rid, params)
                reason = self._claim(key, rid)
                state = SendState.REFUSED if reason else SendState.COMPUTING
                if reason:
                    log.warning("kvpush: prefill request %s will not push its KV: %s", rid, reason)
                self.prefills[rid] = _PrefillRequest(request, key, state, reason)
            return
        if not params.do_remote_prefill or num_external_tokens <= 0:
            return
        log.debug(
            "kvpush alloc %s ext=%d computed=%d blocks=%s",
            rid,
            num_external_tokens,
            request.num_computed_tokens,
            blocks.get_block_ids(),
        )
        # A re-entry (second allocation after preemption) must not register again: compute locally.
        if request.kv_transfer_params is not None:
            request.kv_transfer_params["do_remote_prefill"] = False
        block_ids = tuple(blocks.get_block_ids()[0])
        self.recving[rid] = ""
        missing = params.prefill_address_missing()
        if missing:
            self.meta.fail_recv.append((rid, f"kv_transfer_params lack {', '.join(missing)}"))
            return
        key = transfer_key(rid, params)
        reason = self._claim(key, rid)
        if reason:
            self.meta.fail_recv.append((rid, reason))
            return
        self.recving[rid] = key
        n_blocks = -(-int(request.num_prompt_tokens) // self.settings.block_size)
        self.meta.expect.append(
            RecvItem(
                rid,
                key,
                block_ids[:n_blocks],
                int(request.num_prompt_tokens),
                str(params.remote_engine_id),
                str(params.remote_host),
                int(params.remote_port or 0),
                params.tp_size,
                params.pp_size,
            )
        )

    # ---- every step --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self.meta = self.meta, KVPushConnectorMetadata()
        if scheduler_output.num_scheduled_tokens:
            log.debug("kvpush sched %s", dict(scheduler_output.num_scheduled_tokens))
        if self.prefills:
            self._hand_over_completed_prompts(scheduler_output, meta)
        if self.waiter is not None:
            meta.wake_path = self.waiter.path
            if (
                not scheduler_output.total_num_scheduled_tokens
                and not meta.has_commands()
                and (self.recving or self._holding_prefill_blocks())
            ):
                # Nothing to compute, nothing to tell the worker: only transfers are outstanding.
                # Sleep until one settles (the transfer thread wakes us) or idle_wait_ms passes.
                self.waiter.wait(self.settings.idle_wait_s)
        return meta

    def _hand_over_completed_prompts(
        self, scheduler_output: SchedulerOutput, meta: KVPushConnectorMetadata
    ) -> None:
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            rec = self.prefills.get(rid)
            if rec is None or rec.state is not SendState.COMPUTING:
                continue
            req = rec.request
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # a chunk; the prompt completes in a later step
            mgr = self.kv_cache_manager()
            if mgr is None:
                raise RuntimeError("KVPushConnector needs bind_kv_cache_manager (vLLM >= 0.32)")
            num_tokens = int(req.num_prompt_tokens)
            blocks = mgr.get_block_ids(rid)[0][: -(-num_tokens // self.settings.block_size)]
            meta.send.append(SendItem(rid, rec.key, tuple(blocks), num_tokens))
            rec.state = SendState.HANDED

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        rec = self.prefills.get(rid)
        if rec is not None:
            if rec.state is SendState.REFUSED:
                # Its key belongs to another live request: nothing of ours to abort, free at once.
                del self.prefills[rid]
                return False, None
            if rec.state is SendState.COMPUTING:
                # Never handed over (aborted before its prompt completed): a decode that registered
                # already is told at once instead of waiting for the lease to run out.
                del self.prefills[rid]
                self._release(rec.key, rid)
                self.meta.abort_send.append((rid, rec.key))
                return False, None
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                self.meta.abort_send.append((rid, rec.key))
            rec.state = SendState.SENDING
            cfg = self.settings.config
            answer = KVTransferParams(
                do_remote_prefill=True,
                transfer_mode="push",
                remote_engine_id=cfg.engine_id,
                remote_request_id=rec.key,
                remote_host=cfg.side_channel.host,
                remote_port=cfg.side_channel.port,
                tp_size=self.settings.tp_size,
                pp_size=self.settings.pp_size,
            )
            return True, answer.to_dict()
        if rid in self.recving:
            # Finished (aborted, or failed by policy) before its KV was reported: keep the blocks until
            # the endpoint confirms that no WRITE can still land in them, then finished_recving frees them.
            self.meta.abort_recv.append(rid)
            return True, None
        params = self._params(request)
        if self.is_producer and params is not None and params.do_remote_decode:
            # Dropped before its blocks were allocated: a decode that registered already is told now.
            key = transfer_key(rid, params)
            if self.live_keys.get(key) is None:  # never abort another live request's transfer
                self.meta.abort_send.append((rid, key))
            return False, None
        if (
            not self.is_producer
            and params is not None
            and params.do_remote_prefill
            and params.remote_engine_id
            and params.remote_host
            and params.remote_port
        ):
            # Dropped while still waiting for blocks: nothing of ours to hold, but the prefill may be
            # holding its KV for us; tell it now instead of letting its lease run out.
            key = transfer_key(rid, params)
            if self.live_keys.get(key) is None:  # never cancel another live request's transfer
                self.meta.cancel_recv.append(
                    CancelItem(
                        key,
                        params.remote_engine_id,
                        params.remote_host,
                        params.remote_port,
                        params.tp_size,
                        params.pp_size,
                    )
                )
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_sending or ():
            rec = self.prefills.pop(rid, None)
            if rec is not None:
                self._release(rec.key, rid)
        for rid in connector_output.finished_recving or ():
            key = self.recving.pop(rid, "")
            if key:
                self._release(key, rid)
            log.debug("kvpush finished_recving %s", rid)

    def _holding_prefill_blocks(self) -> bool:
        return any(r.state in (SendState.HANDED, SendState.SENDING) for r in self.prefills.values())

    def has_pending_work(self) -> bool:
        m = self.meta
        return bool(
            self._holding_prefill_blocks()
            or m.send
            or m.abort_send
            or m.expect
            or m.abort_recv
            or m.fail_recv
            or m.cancel_recv
        )
