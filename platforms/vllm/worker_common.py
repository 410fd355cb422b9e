"""What the prefill and decode workers share: the probed cache, the wake-up and the stats plumbing.

The probing lives in probe.py and the stats file in stats.py; the role classes (prefill_worker.py,
decode_worker.py) hold the per-request state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.protocol.layout import KVLayout

from .cache_groups import cache_groups
from .params import ConnectorSettings
from .probe import ProbedCache, probe_kv_caches
from .stats import StatsPublisher, snapshot
from .vllm_stats import DeltaTracker
from .wake import IdleWaker

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class WorkerBase:
    """Set-up and stats plumbing for one TP rank's worker; the role classes hold the per-request state."""

    role = ""

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config: Any = None  # the connector's, set by it: its groups refuse a hybrid cache
        self.kv_caches: dict[str, Any] = {}
        self.cache: ProbedCache | None = None
        self.waker: IdleWaker | None = None
        self.stats: StatsPublisher | None = None
        self.vllm_delta = DeltaTracker(self.role)

    @property
    def layout(self) -> KVLayout:
        assert self.cache is not None, "register_kv_caches has not run"
        return self.cache.layout

    def probe(self, kv_caches: dict[str, Any]) -> ProbedCache:
        self.kv_caches = kv_caches
        self.cache = probe_kv_caches(self.settings, self.vllm_config, kv_caches, self.kv_cache_config)
        return self.cache

    def start_stats(self) -> None:
        if self.settings.stats_dir and self.cache is not None:
            name = f"{self.settings.config.engine_id}-rank{self.cache.rank}.json"
            self.stats = StatsPublisher(Path(self.settings.stats_dir) / name, self.snapshot)
            self.stats.publish(news=True)

    def bind_waker(self, wake_path: str, endpoint: Any) -> None:
        """Point the endpoint's result listener at the scheduler's IdleWaiter (path from the metadata)."""
        if wake_path and (self.waker is None or self.waker.path != wake_path):
            old, self.waker = self.waker, IdleWaker(wake_path)
            endpoint.set_result_listener(self.waker.wake)
            if old is not None:
                old.close()

    # ---- stats (engine thread) ---------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """Role-specific counters for the snapshot (fresh objects: the snapshot is serialised at once)."""
        return {}

    def outstanding(self) -> int:
        return 0

    def endpoint_stats(self) -> dict[str, int]:
        return {}

    def snapshot(self) -> dict[str, Any]:
        out = snapshot(
            self.role,
            self.settings.config.engine_id,
            self.cache.rank if self.cache else 0,
            self.cache.layout if self.cache else None,
            self.counters(),
            self.outstanding(),
            self.endpoint_stats(),
        )
        # vLLM's block (what its window groups free by) and its KV-cache groups, as vLLM declared them
        out["vllm_block_size"] = self.settings.block_size
        out["kv_cache_groups"] = [g.describe() for g in cache_groups(self.kv_cache_config)]
        return out

    def take_vllm_stats(self) -> dict[str, Any] | None:
        """The change in this worker's counters since the last call, for vLLM's connector stats."""
        return self.vllm_delta.take(self.counters())

    def publish_stats(self, news: bool = False) -> None:
        if self.stats is not None:
            self.stats.publish(news)

    def close_stats(self) -> None:
        if self.stats is not None:
            self.stats.close()
            self.stats = None

    def close_waker(self) -> None:
        if self.waker is not None:
            self.waker.close()
            self.waker = None
