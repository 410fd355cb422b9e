"""The decode engine's scheduler side (kv_consumer).

* get_num_new_matched_tokens: a request with `do_remote_prefill` will receive its whole prompt's KV.
* update_state_after_alloc: the blocks are allocated; they go into this step's metadata and the worker
  calls DecodeEndpoint.expect() at the start of the same step (the registration leaves at once).
* request_finished: a request aborted while waiting keeps its blocks until the endpoint says no WRITE can
  still land; one dropped before allocation cancels the prefill's hold on its KV.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvpush.endpoint import PrefillAddress
from kvpush.protocol.layout import blocks_for

from .block_table import group_ids
from .params import ConnectorSettings, KVTransferParams, transfer_key
from .scheduler import CancelItem, FailItem, RecvItem, SchedulerBase, pushed_tokens

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.vllm")


def prefill_address(params: KVTransferParams) -> PrefillAddress:
    """Where the request's prefill is (call once `params.prefill_address_missing()` is empty). A pp_size
    the router left out is 1: KVTransferParams refuses any other, and a kvpush prefill runs no other."""
    return PrefillAddress(
        str(params.remote_engine_id),
        str(params.remote_host),
        int(params.remote_port or 0),
        params.tp_size,
        1 if params.pp_size is None else params.pp_size,
    )


class DecodeScheduler(SchedulerBase):
    """Which requests receive their prompt's KV, into which blocks, and when vLLM may free them."""

    def __init__(self, settings: ConnectorSettings, backoff: int = 0) -> None:
        super().__init__(settings)
        self.backoff = backoff  # last prompt tokens the prefill leaves for us to compute (window_backoff)
        self.recving: dict[str, str] = {}  # request id -> its transfer key ("" if it has none)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self._params(request)
        if params is None or not params.do_remote_prefill:
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
        n = pushed_tokens(int(request.num_prompt_tokens), self.backoff)
        return (n, True) if n > 0 else (0, False)

    def may_load_async(self, request: Request) -> bool:
        """Whether get_num_new_matched_tokens will answer load_kv_async=True for this request; vLLM >= 0.34
        asks whenever it enters the waiting queues. With --max-num-inflight-kv-loads, a request answering
        True may get its blocks (and kvpush registers them with its prefill, in that step's metadata) while
        the running batch is full, so the push lands before a slot frees; the flag caps how many do. A
        false positive holds back other loads, so this is the same test, quietly: a valid do_remote_prefill
        and a prompt to push. Only a local prefix hit, which the allocation reveals, can still turn it
        down (decode should run without prefix caching). A preempted request, whose do_remote_prefill
        update_state_after_alloc cleared, answers False."""
        raw = request.kv_transfer_params
        if not isinstance(raw, Mapping) or not raw.get("do_remote_prefill"):
            return False
        try:
            params = KVTransferParams.from_dict(raw)
        except ValueError:  # refused (with a warning) in get_num_new_matched_tokens: no load
            return False
        return params.do_remote_prefill and pushed_tokens(int(request.num_prompt_tokens), self.backoff) > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        if params is None or not params.do_remote_prefill or num_external_tokens <= 0:
            return
        rid = request.request_id
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
        self.recving[rid] = ""
        num_tokens = pushed_tokens(int(request.num_prompt_tokens), self.backoff)
        block_ids = group_ids(blocks.get_block_ids(), blocks_for(num_tokens, self.settings.block_size))
        missing = params.prefill_address_missing()
        if missing:
            self.meta.fail_recv.append(
                FailItem(rid, f"kv_transfer_params lack {', '.join(missing)}", block_ids)
            )
            return
        key = transfer_key(rid, params)
        reason = self._claim(key, rid)
        if reason:
            self.meta.fail_recv.append(FailItem(rid, reason, block_ids))
            return
        self.recving[rid] = key
        self.meta.expect.append(RecvItem(rid, key, block_ids, num_tokens, prefill_address(params)))

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks?, None): held while a WRITE may still land in them."""
        rid = request.request_id
        if rid in self.recving:
            # Finished (aborted, or failed by policy) before its KV was reported: keep the blocks until
            # the endpoint confirms that no WRITE can still land in them, then finished_recving frees them.
            self.meta.abort_recv.append(rid)
            return True, None
        self._cancel_unallocated(request)
        return False, None

    def _cancel_unallocated(self, request: Request) -> None:
        """Dropped while still waiting for blocks: nothing of ours to hold, but the prefill may be holding
        its KV for us; tell it now instead of letting its lease run out."""
        params = self._params(request)
        if params is None or not params.do_remote_prefill or params.prefill_address_missing():
            return
        key = transfer_key(request.request_id, params)
        if self._key_is_free(key):  # never cancel another live request's transfer
            self.meta.cancel_recv.append(CancelItem(key, prefill_address(params)))

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            key = self.recving.pop(rid, "")
            if key:
                self._release(key, rid)
            log.debug("kvpush finished_recving %s", rid)

    def _awaiting_transfers(self) -> bool:
        return bool(self.recving)
