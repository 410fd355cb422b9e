"""What the prefill and decode workers share: probing the KV caches into a layout, the wake-up, stats.

Stats: the worker builds an immutable snapshot (a JSON string) on the engine thread, where its state
lives, at the end of get_finished and whenever it has news; a small writer thread only copies the latest
string to disk. No thread ever reads the worker's own dicts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.backends.select import CacheSetup, setup_for_tensors
from kvpush.protocol.layout import KVLayout

from .layout_probe import (
    CPU_VIEW,
    RFC_VIEW,
    KVCacheDeclaration,
    declaration_from_backend,
    features_from_vllm,
    probe_layout,
)
from .params import ConnectorSettings
from .wake import IdleWaker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpush.vllm")

CPU_BACKEND = "CPU_ATTN"


def tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


def attention_backend(vllm_config: VllmConfig, kv_caches: dict[str, Any]) -> tuple[str, Any]:
    """(name, class) of the attention backend: it decides how a block's bytes are read; ask the first
    layer. The class is None when the layer does not say (then the tensors' device decides the name)."""
    ctx = vllm_config.compilation_config.static_forward_context
    layer = ctx.get(next(iter(kv_caches)))
    try:
        cls = layer.get_attn_backend()  # type: ignore[union-attr]
        return str(cls.get_name()), cls
    except AttributeError:
        return (CPU_BACKEND if next(iter(kv_caches.values())).device.type == "cpu" else ""), None


def declared_layout(name: str, cls: Any, first_tensor: Any) -> KVCacheDeclaration | None:
    """What the backend declares about its KV tensors: its own get_kv_cache_shape where it has one
    (vllm-neuron, older vLLM), else vLLM >= 0.32's per-layer [B, H, N, C] view (the CPU backend reads a
    head's block as [2N, C/2]); None leaves the probe to refuse anything ambiguous."""
    declared = declaration_from_backend(cls) if cls is not None else None
    if declared is not None:
        return declared
    if name == CPU_BACKEND:
        return CPU_VIEW
    return RFC_VIEW if first_tensor.dim() == 4 else None


def model_tag(vllm_config: VllmConfig, user_tag: str) -> str:
    """What must match between the two engines' models beyond the KV geometry."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [])
    tag = (
        f"{arch}|layers={getattr(hf, 'num_hidden_layers', '?')}|hidden={getattr(hf, 'hidden_size', '?')}"
        f"|vocab={getattr(hf, 'vocab_size', '?')}|dtype={mc.dtype}"
    )
    return f"{tag}|{user_tag}" if user_tag else tag


@dataclasses.dataclass(frozen=True)
class ProbedCache:
    layout: KVLayout  # what the endpoint registers (the host bounce buffer when staged)
    ratio: int  # kernel blocks per vLLM block
    mem_type: str  # "DRAM" | "VRAM"
    rank: int
    setup: CacheSetup  # the backend: its KV-written barrier and, when staged, the staging hooks

    def kv_written_barrier(self) -> Any:
        """Called on the engine thread at hand-off; never waits (CUDA: records an event)."""
        return self.setup.cache.kv_written_barrier()


def probe_kv_caches(
    settings: ConnectorSettings, vllm_config: VllmConfig, kv_caches: dict[str, Any]
) -> ProbedCache:
    rank = tensor_parallel_rank()
    backend, backend_cls = attention_backend(vllm_config, kv_caches)
    first = next(iter(kv_caches.values()))
    probed = probe_layout(
        kv_caches,
        block_size=settings.block_size,
        total_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
        tp_rank=rank,
        tp_size=settings.tp_size,
        model_tag=model_tag(vllm_config, settings.model_tag),
        declared=declared_layout(backend, backend_cls, first),
        features=features_from_vllm(vllm_config),
    )
    layout, ratio = probed.layout, probed.blocks_per_vllm_block
    if backend == CPU_BACKEND:
        # vLLM's CPU kernels keep tokens inside a block in their own packed order: a partial block
        # cannot be cut by token, so blocks move whole (the plan rounds; block sizes must match).
        layout = dataclasses.replace(layout, atomic_blocks=True)
    ktc = vllm_config.kv_transfer_config
    kv_buffer_device = str(getattr(ktc, "kv_buffer_device", None) or "cpu")
    setup = setup_for_tensors(layout, kv_caches, kv_buffer_device)
    mem_type = setup.mem_type
    log.warning(
        "kvpush: %s rank %d %s compat %s (%d layers, %d KV heads x %d, block %d tokens, %d B/block, "
        "%s, %d kernel blocks per vLLM block of %d%s)",
        settings.role,
        rank,
        mem_type,
        layout.compat_hash(),
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.block_bytes,
        layout.token_order,
        ratio,
        settings.block_size,
        ", whole blocks" if layout.atomic_blocks else "",
    )
    if setup.hooks is not None:
        log.warning("kvpush: KV staged through host memory (%s)", setup.choice.reason)
    return ProbedCache(setup.layout, ratio, mem_type, rank, setup)


def debug_checksums(
    kv_caches: dict[str, Any], blocks: list[int], num_tokens: int, block_size: int
) -> list[float]:
    """Sums of the first and last layer's KV over a request's tokens: compare prefill's with decode's
    in DEBUG logs when outputs differ. Costly; callers check log.isEnabledFor(DEBUG) first."""
    out = []
    names = list(kv_caches)
    for name in names[:1] + names[-1:]:
        t = kv_caches[name]
        total = 0.0
        for i, b in enumerate(blocks):
            k = min(block_size, num_tokens - i * block_size)
            if k <= 0:
                break
            part = t[b][:, :k] if t.dim() == 4 else t[:, b, :k]
            total += float(part.double().sum())
        out.append(round(total, 4))
    return out


def kvpush_threads() -> dict[str, int]:
    """kvpush's own threads in this process (the benchmark measures their idle CPU from /proc)."""
    return {
        t.name: t.native_id
        for t in threading.enumerate()
        if t.name.startswith("kvpush") and t.native_id is not None
    }


class StatsWriter:
    """Writes the latest published snapshot to <dir>/<engine>-rank<r>.json from its own thread.

    publish() takes an immutable JSON string built on the engine thread; the writer never looks at the
    worker's state, so nothing is shared between threads but one string reference.
    """

    def __init__(self, path: Path, period_s: float = 0.25) -> None:
        self.path = path
        self.period_s = period_s
        self._latest: str | None = None
        self._written: str | None = None
        self._news = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpush-stats", daemon=True)
        self._thread.start()

    def publish(self, snapshot: str) -> None:
        self._latest = snapshot
        self._news.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._news.wait(1.0)
            self._news.clear()
            self._flush()
            self._stop.wait(self.period_s)

    def _flush(self) -> None:
        latest = self._latest
        if latest is None or latest is self._written:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(latest)
            tmp.replace(self.path)
            self._written = latest
        except OSError as exc:
            log.warning("kvpush: cannot write stats to %s: %s", self.path, exc)

    def close(self, final: str | None = None) -> None:
        self._stop.set()
        self._news.set()
        self._thread.join(5)
        if final is not None:
            self._latest = final
        self._flush()


class WorkerBase:
    """Set-up and stats plumbing for one TP rank's worker; the role classes hold the per-request state."""

    role = ""

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_caches: dict[str, Any] = {}
        self.cache: ProbedCache | None = None
        self.waker: IdleWaker | None = None
        self.stats_writer: StatsWriter | None = None
        self._last_snapshot = 0.0

    @property
    def layout(self) -> KVLayout:
        assert self.cache is not None, "register_kv_caches has not run"
        return self.cache.layout

    def probe(self, kv_caches: dict[str, Any]) -> ProbedCache:
        self.kv_caches = kv_caches
        self.cache = probe_kv_caches(self.settings, self.vllm_config, kv_caches)
        return self.cache

    def start_stats(self) -> None:
        if self.settings.stats_dir and self.cache is not None:
            path = (
                Path(self.settings.stats_dir) / f"{self.settings.config.engine_id}-rank{self.cache.rank}.json"
            )
            self.stats_writer = StatsWriter(path)
            self.publish_stats(news=True)

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
        out: dict[str, Any] = dict(self.counters())
        out.update(
            role=self.role,
            engine_id=self.settings.config.engine_id,
            rank=self.cache.rank if self.cache else 0,
            pid=os.getpid(),
            time=time.time(),
            threads=kvpush_threads(),
            outstanding=self.outstanding(),
        )
        if self.cache is not None:
            out["compat"] = self.cache.layout.compat_hash()
            out["bytes_per_token"] = self.cache.layout.bytes_per_token
            out["atomic_blocks"] = self.cache.layout.atomic_blocks
        ep = self.endpoint_stats()
        out["endpoint"] = ep
        out["order_counts"] = {k: ep[k] for k in ("registration_first", "prefill_first") if k in ep}
        out["pending"] = ep.get("pending")
        return out

    def publish_stats(self, news: bool = False) -> None:
        """Build the snapshot here, on the engine thread, and hand the writer its JSON: at once when a
        request changed state (news), otherwise at most every 0.5 s while the engine steps."""
        if self.stats_writer is None:
            return
        now = time.monotonic()
        if not news and now - self._last_snapshot < 0.5:
            return
        self._last_snapshot = now
        self.stats_writer.publish(json.dumps(self.snapshot()))

    def close_stats(self) -> None:
        if self.stats_writer is not None:
            self.stats_writer.close(json.dumps(self.snapshot()))
            self.stats_writer = None

    def close_waker(self) -> None:
        if self.waker is not None:
            self.waker.close()
            self.waker = None
