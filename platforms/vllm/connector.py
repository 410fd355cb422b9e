"""KVPushConnector: the class vLLM loads (`kv_connector_module_path: "kvpush.platforms.vllm"`).

A facade only: it reads vLLM's config once into ConnectorSettings and delegates each call by role:
  * scheduler side: prefill_scheduler.PrefillScheduler (kv_producer) or
    decode_scheduler.DecodeScheduler (kv_consumer), on what scheduler.py gives both
  * worker side: prefill_worker.PrefillWorker (kv_producer) or decode_worker.DecodeWorker (kv_consumer)
The flow of one request is described in the two scheduler and the two worker modules.

One class for vLLM 0.29 through 0.34, by feature, not version: block ids come from the KV cache manager
where vLLM binds one (>= 0.32), else from the scheduler outputs (block_table.py); results go out through
whichever method vLLM calls: get_transfer_results (>= 0.32: failed_recving) or get_finished, whose
failures then reach vLLM as invalid blocks (get_block_ids_with_load_errors, the one channel before 0.32).
The classmethods vLLM asks before any engine exists (kv_cache_access, supports_sleep_mode,
requires_piecewise_for_cudagraph) answer from contract.py; a vLLM that lacks one never calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpush.errors import ConfigError, LocalProtocolError

from .block_table import manager_or_table
from .cache_groups import CacheGroup, cache_groups, groups_block_size
from .contract import SUPPORTS_SLEEP_MODE, KVCacheAccess, kv_cache_access, layer_hooks_carry_work
from .decode_scheduler import DecodeScheduler
from .decode_worker import DecodeWorker
from .params import ConnectorSettings, KVTransferParams, required_kv_cache_layout, transfer_key
from .prefill_scheduler import PrefillScheduler
from .prefill_worker import PrefillWorker
from .scheduler import KVPushConnectorMetadata, window_backoff
from .vllm_stats import HAVE_HOOKS, KVPushPromMetrics, KVPushStats

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM

    class SupportsHMA:  # type: ignore[no-redef]
        pass


if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KVPushConnector", "KVPushConnectorMetadata", "KVTransferParams", "transfer_key"]


def settings_from_vllm(vllm_config: VllmConfig, groups: tuple[CacheGroup, ...] = ()) -> ConnectorSettings:
    """groups: vLLM's KV-cache groups (cache_groups); their spec's block size is the tables' block size
    where it differs from cache_config's (groups_block_size)."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError("KVPushConnector needs --kv-transfer-config")
    if ktc.is_kv_producer and ktc.is_kv_consumer:
        raise ConfigError(
            "KVPushConnector: kv_role must be kv_producer (prefill) or kv_consumer (decode), not kv_both"
        )
    pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp_size != 1:
        raise ConfigError("KVPushConnector does not support pipeline parallelism yet (pp_size must be 1)")
    return ConnectorSettings.from_extra(
        "prefill" if ktc.is_kv_producer else "decode",
        str(ktc.engine_id or "kvpush"),
        dict(ktc.kv_connector_extra_config or {}),
        block_size=groups_block_size(groups, int(vllm_config.cache_config.block_size)),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        pp_size=pp_size,
    )


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push KV from prefill to decode with kvpush; vLLM makes one per role (scheduler, each worker)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        if kv_cache_config is None:
            super().__init__(vllm_config, role)  # type: ignore[call-arg]  # older vLLM
        else:
            super().__init__(vllm_config, role, kv_cache_config)
        # vLLM's KV-cache groups (one block table each); () where vLLM passes no KV-cache config
        self.groups = cache_groups(kv_cache_config)
        self.settings = settings_from_vllm(vllm_config, self.groups)
        self._sched: PrefillScheduler | DecodeScheduler | None = None
        self._worker: PrefillWorker | DecodeWorker | None = None
        # Which method vLLM collects results with decides how failures reach it (see get_finished).
        self._failures_by_blocks = False
        self._ended: KVPushConnectorMetadata | None = None  # the step metadata end_step last ran for
        backoff = window_backoff(self.groups)
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.is_producer:
                sched = PrefillScheduler(self.settings, backoff=backoff)
                # vLLM >= 0.32 binds its KV cache manager after constructing the connector; older vLLM
                # never does, and the scheduler's own table (fed from the scheduler outputs) answers.
                sched.block_ids = manager_or_table(
                    lambda: getattr(self, "_kv_cache_manager", None), sched.table.block_ids
                )
                self._sched = sched
            else:
                self._sched = DecodeScheduler(self.settings, backoff=backoff)
        elif self.settings.is_producer:
            self._worker = PrefillWorker(self.settings, vllm_config)
        else:
            self._worker = DecodeWorker(self.settings, vllm_config)
        if self._worker is not None:
            self._worker.kv_cache_config = kv_cache_config  # hybrid KV cache groups are refused by the probe

    def _scheduler(self) -> PrefillScheduler | DecodeScheduler:
        if self._sched is None:
            raise LocalProtocolError(
                "KVPushConnector: a scheduler-side method was called on a worker connector"
            )
        return self._sched

    def _work(self) -> PrefillWorker | DecodeWorker:
        if self._worker is None:
            raise LocalProtocolError(
                "KVPushConnector: a worker-side method was called on the scheduler connector"
            )
        return self._worker

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group: kvpush writes each group's blocks (vLLM zeroes the blocks of groups not named)."""
        return tuple(range(len(self.groups))) or (0,)

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34 (with --max-num-inflight-kv-loads): whether the request may be allocated, and so
        registered with its prefill, while the running batch is full. Only a decode loads; see
        DecodeScheduler.may_load_async."""
        sched = self._sched
        return isinstance(sched, DecodeScheduler) and sched.may_load_async(request)

    def on_new_request(self, request: Request) -> None:
        if isinstance(self._sched, PrefillScheduler):
            self._sched.on_new_request(request)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None (adapt to the backend's layout; both sides must agree, the handshake checks) unless extra
        config kv_cache_layout asks for a block-outermost cache, which the plan moves as one run per
        block across all layers. Prefill and decode must be configured alike."""
        from vllm.platforms import current_platform

        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
        return required_kv_cache_layout(extra, bool(current_platform.is_cpu()))

    # ---- asked by vLLM's config process, before any engine exists (contract.py) --------------------
    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> KVCacheAccess:
        """vLLM >= 0.34: device memory registered with NIXL needs one physical allocation per segment
        (REGISTERS) and exportable pages for CUDA IPC within a host (EXPORTS_FABRIC); host staging
        (kv_buffer_device "cpu") only copies in process (IN_PROCESS)."""
        return kv_cache_access(getattr(kv_transfer_config, "kv_buffer_device", None))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM >= 0.33: False, so vLLM refuses --enable-sleep-mode: a slept decode's KV memory is freed
        while its NIXL registrations, and the WRITEs prefills aim at them, live on."""
        return SUPPORTS_SLEEP_MODE

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True with stream_layers > 0: full CUDA graph replay would skip save_kv_layer, and with it
        every layer-group push."""
        return layer_hooks_carry_work(extra_config)

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Before every forward pass (all vLLM versions; start_load_kv may come after it): the prefill
        names the prompts this step completes, so their WRITEs are made while the model runs."""
        super().bind_connector_metadata(connector_metadata)
        worker = self._worker
        if isinstance(worker, PrefillWorker) and isinstance(connector_metadata, KVPushConnectorMetadata):
            worker.name_sources(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVPushConnectorMetadata):
            self._work().start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """After each attention layer (vLLM's maybe_transfer_kv_layer): layer-group push, when on."""
        worker = self._worker
        meta = self._connector_metadata
        if (
            isinstance(worker, PrefillWorker)
            and worker.groups is not None
            and isinstance(meta, KVPushConnectorMetadata)
        ):
            worker.save_kv_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        self._end_step(forward=True)

    def _end_step(self, forward: bool) -> None:
        """The worker's end of this step, once per step's metadata. `forward` False (from get_finished):
        only for a step without a forward pass, where vLLM < 0.32 never calls wait_for_save
        (kv_connector_no_forward passes wait_for_save=False): the scheduler's commands of that step (the
        terminal call that ends a push aborted mid-stream, aborts) would be lost and vLLM would hold the
        request's blocks for good. A step with a forward pass is ended by wait_for_save only, after it."""
        meta = self._connector_metadata
        if not isinstance(meta, KVPushConnectorMetadata) or meta is self._ended:
            return
        if not forward and meta.forward:
            return
        self._ended = meta
        self._work().end_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM < 0.32 collects results here: a failed receive is reported finished, and its blocks
        follow in get_block_ids_with_load_errors, which vLLM calls right after in the same step."""
        self._failures_by_blocks = True
        self._end_step(forward=False)
        sending, recving, _failed = self._work().collect(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32 collects results here, failures in failed_recving."""
        if KVConnectorTransferResults is None:  # pragma: no cover - vLLM < 0.32 calls get_finished
            raise LocalProtocolError(
                "get_transfer_results called on a vLLM without KVConnectorTransferResults"
            )
        self._failures_by_blocks = False
        self._end_step(forward=False)  # 0.32 ends every step in wait_for_save; should a step come without
        sending, recving, failed = self._work().collect(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Every block of each request that failed since the last call, when vLLM learns of failures
        only from blocks (it collected through get_finished); empty when failed_recving carried them."""
        worker = self._work()
        if not isinstance(worker, DecodeWorker):
            return set()
        blocks = worker.take_failed_blocks()
        return blocks if self._failures_by_blocks else set()

    # ---- vLLM's connector stats (feature-detected in vllm_stats) -------------------------------
    def get_kv_connector_stats(self) -> Any:
        """The worker's change since the last step; vLLM sums the ranks and shows it on its /metrics."""
        if not HAVE_HOOKS or self._worker is None:
            return None
        data = self._worker.take_vllm_stats()
        return None if data is None else KVPushStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if not HAVE_HOOKS:
            return None
        return KVPushStats(data=dict(data)) if data else KVPushStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        if not HAVE_HOOKS:
            return None
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
