"""What both roles' scheduler sides share: the step metadata, transfer-key claims and the idle wait.

vLLM makes one scheduler-side connector per engine; the facade (connector.py) builds the role's own
scheduler: `prefill_scheduler.PrefillScheduler` (kv_producer) or `decode_scheduler.DecodeScheduler`
(kv_consumer). Each step's `KVPushConnectorMetadata` carries the scheduler's commands to the workers.

Transfer keys are unique among live requests on each side: a request whose key is already taken by a
live one (a client reusing X-Request-Id without a router's transfer_id) is refused with a reason and its
blocks released, instead of silently replacing the first one in the endpoint.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpush.endpoint import PrefillAddress

from .block_table import GroupIds
from .cache_groups import CacheGroup
from .params import ConnectorSettings, KVTransferParams
from .wake import IdleWaiter

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.vllm")


def window_backoff(groups: Sequence[CacheGroup]) -> int:
    """Prompt tokens the prefill leaves for the decode to compute: 1 with a sliding-window group, else 0.

    Why: a prefill that computed N tokens frees, when it finishes, every block before the window of
    position N (vLLM keeps tokens N - window + 1 .. N - 1). A decode handed all N tokens recomputes
    position N - 1, whose window reaches back to N - window: one token further. At N % block_size ==
    block_size - 1 that token sits alone in a block the prefill has freed. So, as vLLM's own connector
    does for Mamba, the prefill computes N - 1 tokens and the decode computes position N - 1 itself:
    what the prefill keeps (N - window .. N - 2) is exactly what the decode's next position reads."""
    return 1 if any(g.kind == "window" for g in groups) else 0


def pushed_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """Prompt tokens whose KV the prefill pushes (both sides compute it from the prompt alone)."""
    return num_prompt_tokens - backoff if num_prompt_tokens > backoff else num_prompt_tokens


def cut_prompt(request: Request, backoff: int) -> None:
    """Drop the last `backoff` prompt tokens of a prefill request (vLLM's Request fields), so it computes
    and keeps KV for exactly `pushed_tokens` tokens; it then samples one token, as a prefill does."""
    n = int(request.num_prompt_tokens)
    if pushed_tokens(n, backoff) == n or request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens = n - backoff
    request.max_tokens = 1


@dataclass(frozen=True)
class RecvItem:
    """Decode: register these blocks for this request's KV (worker calls DecodeEndpoint.expect)."""

    req_id: str  # vLLM's internal id
    key: str
    block_ids: GroupIds  # one table, or one per KV-cache group
    num_tokens: int
    prefill: PrefillAddress


@dataclass(frozen=True)
class FailItem:
    """Decode: the scheduler side refused this request's transfer (no prefill address, a taken key).
    Its blocks travel with it: vLLM < 0.32 learns of a failed load only from its blocks
    (`get_block_ids_with_load_errors`); without them it would decode on KV that never arrived."""

    req_id: str
    reason: str
    block_ids: GroupIds


@dataclass(frozen=True)
class CancelItem:
    """Decode: a request dropped before allocation; the prefill may hold KV for it, so tell it."""

    key: str
    prefill: PrefillAddress


@dataclass(frozen=True)
class SendItem:
    """Prefill: this request's prompt KV is computed by this step's forward pass; push it."""

    req_id: str
    key: str
    block_ids: GroupIds  # one table, or one per KV-cache group
    num_tokens: int
    decode_engine_id: str = ""  # the decode the router named (kv_transfer_params); "" = not named


@dataclass
class KVPushConnectorMetadata(KVConnectorMetadata):
    expect: list[RecvItem] = field(default_factory=list)
    fail_recv: list[FailItem] = field(default_factory=list)
    abort_recv: list[str] = field(default_factory=list)
    cancel_recv: list[CancelItem] = field(default_factory=list)
    send: list[SendItem] = field(default_factory=list)
    ready: list[SendItem] = field(default_factory=list)  # streamed: this step's chunk is computed (kv_ready)
    stop: list[SendItem] = field(default_factory=list)  # streamed and aborted: abort, then the terminal call
    abort_send: list[tuple[str, str]] = field(default_factory=list)  # (req_id, key)
    wake_path: str = ""  # the scheduler's IdleWaiter; workers wake it when a transfer settles
    # the step runs a forward pass (tokens scheduled). vLLM < 0.32 does not call wait_for_save on a step
    # without one (kv_connector_no_forward), so the connector ends such a step in get_finished instead
    forward: bool = True

    def has_commands(self) -> bool:
        return bool(
            self.expect
            or self.fail_recv
            or self.abort_recv
            or self.cancel_recv
            or self.send
            or self.ready
            or self.stop
            or self.abort_send
        )


class SchedulerBase:
    """The step metadata being built, transfer-key claims and the idle wait; the roles add their hooks."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.meta = KVPushConnectorMetadata()
        self.live_keys: dict[str, str] = {}  # transfer key -> the live request id that owns it
        self.waiter: IdleWaiter | None = None
        if settings.idle_wait_s > 0:
            self.waiter = IdleWaiter()
            atexit.register(self.waiter.close)

    # ---- the role's answers ------------------------------------------------------------------
    def _add_to_step(self, scheduler_output: SchedulerOutput, meta: KVPushConnectorMetadata) -> None:
        """Put what this step's schedule decides into its metadata (prefill: completed prompts)."""

    def _awaiting_transfers(self) -> bool:
        """Whether a transfer of ours is outstanding (an idle engine may then sleep until it settles)."""
        return False

    def _holding_blocks(self) -> bool:
        """Whether vLLM blocks wait for a transfer of ours (vLLM must keep stepping to free them)."""
        return False

    # ---- vLLM's hooks shared by both roles -----------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self.meta = self.meta, KVPushConnectorMetadata()
        if scheduler_output.num_scheduled_tokens:
            log.debug("kvpush sched %s", dict(scheduler_output.num_scheduled_tokens))
        self._add_to_step(scheduler_output, meta)
        meta.forward = bool(scheduler_output.total_num_scheduled_tokens)
        if self.waiter is not None:
            meta.wake_path = self.waiter.path
            if (
                not scheduler_output.total_num_scheduled_tokens
                and not meta.has_commands()
                and self._awaiting_transfers()
            ):
                # Nothing to compute, nothing to tell the worker: only transfers are outstanding.
                # Sleep until one settles (the transfer thread wakes us) or idle_wait_ms passes.
                self.waiter.wait(self.settings.idle_wait_s)
        return meta

    def has_pending_work(self) -> bool:
        return self._holding_blocks() or self.meta.has_commands()

    # ---- helpers -----------------------------------------------------------------------------
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

    def _key_is_free(self, key: str) -> bool:
        """No live request owns `key` (an abort or cancel under it would hit that request's transfer)."""
        return self.live_keys.get(key) is None
