"""KVPushConnector: kvpush as a vLLM v1 KV connector (both roles).

Decode (kv_consumer):
  * get_num_new_matched_tokens: a request with `do_remote_prefill` will receive its whole prompt's KV.
  * update_state_after_alloc: the blocks are allocated; they go into this step's metadata and the worker
    calls DecodeEndpoint.expect() at the start of the same step (the registration leaves at once).
  * worker get_finished: DecodeEndpoint.finished() -> finished_recving; a failure is also reported as
    failed_recving (vLLM 0.32+) or as invalid block ids (older), so kv_load_failure_policy decides
    between failing the request and recomputing it.
  * a request aborted while waiting keeps its blocks until the endpoint says no WRITE can still land.

Prefill (kv_producer):
  * build_connector_meta: a `do_remote_decode` request whose prompt completes in this step is listed in
    this step's metadata; the worker calls PrefillEndpoint.prefill_done() in wait_for_save(), right after
    the forward pass that wrote the last KV, not one engine step later when request_finished's news
    would reach it.
  * request_finished: delay freeing; the worker reports finished_sending once the WRITE completed (or
    failed, or was aborted), and only for requests the scheduler has already seen finish.

The endpoints' background threads drive WRITEs to completion and deliver notifications themselves, so
neither side depends on the engine's step cadence. An engine step with nothing to compute while only
transfers are outstanding sleeps (up to idle_wait_ms) until the transfer thread wakes it (wake.py),
instead of stepping in a tight loop. Layout compatibility is checked in the handshake
(hash and geometry); a decode configured with `prefill_addresses` handshakes at start-up and refuses to
start on a mismatch.

The shared transfer key is derived from the router's X-Request-Id (see transfer_key).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM

    class SupportsHMA:  # type: ignore[no-redef]
        pass


import contextlib

from kvpush.config import KVPushConfig
from kvpush.protocol.layout import LayoutError

from .layout_probe import expand_blocks
from .wake import IdleWaiter, IdleWaker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.vllm")
_DEBUG = bool(os.environ.get("KVPUSH_DEBUG"))

# kv_connector_extra_config keys that belong to the vLLM integration; everything else is KVPushConfig.
_OWN_KEYS = ("stats_dir", "prefill_addresses", "model_tag", "connect_timeout_s", "idle_wait_ms")
# How long an engine with nothing to compute, waiting only on transfers, sleeps per step (a finished
# transfer wakes it at once; a new request waits at most this long). Decode waits through whole
# prefills; prefill only for its WRITEs to finish, and new prompts arrive there, so it naps briefly.
_IDLE_WAIT_MS = {"decode": 20.0, "prefill": 2.0}
_SUFFIX = re.compile(r"-[0-9A-Za-z]{8}$")


def transfer_key(internal_id: str, params: dict[str, Any] | None) -> str:
    """The id both engines agree on for one request.

    The router sends the same X-Request-Id to both engines and the same route, so both build the same
    internal id ("cmpl-<X-Request-Id>-<prompt index>") and then append 8 random characters of their own.
    Dropping those 8 gives the same key on both sides, for completions with several prompts as well.
    A router may also name the key explicitly with kv_transfer_params["transfer_id"] on both sides.
    """
    explicit = (params or {}).get("transfer_id")
    if explicit:
        return str(explicit)
    return _SUFFIX.sub("", internal_id)


@dataclass(frozen=True)
class RecvItem:
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
class SendItem:
    req_id: str
    key: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class KVPushConnectorMetadata(KVConnectorMetadata):
    expect: list[RecvItem] = field(default_factory=list)
    fail_recv: list[tuple[str, str]] = field(default_factory=list)  # (req_id, reason)
    abort_recv: list[str] = field(default_factory=list)
    # dropped before allocation: (key, prefill engine id, host, port, tp, pp) so prefill frees at once
    cancel_recv: list[tuple[str, str, str, int, int, int]] = field(default_factory=list)
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


def _split_extra(extra: dict[str, Any], engine_id: str) -> tuple[KVPushConfig, dict[str, Any]]:
    own = {k: extra[k] for k in _OWN_KEYS if k in extra}
    core = {k: v for k, v in extra.items() if k not in _OWN_KEYS}
    core.setdefault("engine_id", engine_id)
    if isinstance(core.get("backends"), list):
        core["backends"] = tuple(core["backends"])
    return KVPushConfig.from_mapping(core), own


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push KV from prefill to decode with kvpush; see the module docstring for the flow."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        if kv_cache_config is None:
            super().__init__(vllm_config, role)  # type: ignore[call-arg]  # older vLLM
        else:
            super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        if self.is_producer and self.is_consumer:
            raise ValueError(
                "KVPushConnector: kv_role must be kv_producer (prefill) or kv_consumer (decode), not kv_both"
            )
        engine_id = str(ktc.engine_id or "kvpush")
        self.config, self.own = _split_extra(dict(ktc.kv_connector_extra_config or {}), engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
        if self.pp_size != 1:
            raise ValueError("KVPushConnector does not support pipeline parallelism yet (pp_size must be 1)")
        self._sched: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self)
        else:
            self._worker = _Worker(self, vllm_config)

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return (0,)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # kvpush adapts to the backend's layout; both sides must simply agree (checked)

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVPushConnectorMetadata):
            self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVPushConnectorMetadata):
            self._worker.end_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving, failed = self._worker.collect(finished_req_ids)
        self._worker.legacy_failed |= failed
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        assert self._worker is not None
        sending, recving, failed = self._worker.collect(finished_req_ids)
        if KVConnectorTransferResults is None:  # pragma: no cover - older vLLM uses get_finished
            self._worker.legacy_failed |= failed
            return sending, recving
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Only for vLLM without failed_recving: a failed request's blocks are all invalid."""
        assert self._worker is not None
        return self._worker.take_legacy_failed_blocks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


# ======================================================================================================
# scheduler side
# ======================================================================================================
class _Scheduler:
    def __init__(self, conn: KVPushConnector):
        self.conn = conn
        self.meta = KVPushConnectorMetadata()
        self.prefill_reqs: dict[str, Request] = {}  # P: do_remote_decode requests not yet finished
        self.handed: set[str] = set()  # P: handed to the push thread, blocks held by us
        self.sending: set[str] = set()  # P: finished requests whose blocks wait for finished_sending
        self.recving: dict[str, tuple[int, ...]] = {}  # D: registered, KV not yet reported
        role = "prefill" if conn.is_producer else "decode"
        self.idle_wait_s = float(conn.own.get("idle_wait_ms", _IDLE_WAIT_MS[role])) / 1000.0
        if self.idle_wait_s < 0:
            raise ValueError(f"KVPushConnector: idle_wait_ms must be >= 0, got {self.idle_wait_s * 1000:g}")
        self.waiter: IdleWaiter | None = None
        if self.idle_wait_s > 0:
            self.waiter = IdleWaiter()
            atexit.register(self.waiter.close)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.conn.is_consumer:
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
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if params.get("do_remote_decode") and self.conn.is_producer:
            self.prefill_reqs[rid] = request
            return
        if not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        if _DEBUG:
            log.warning(
                "kvpush debug alloc %s ext=%d computed=%d blocks=%s",
                rid,
                num_external_tokens,
                request.num_computed_tokens,
                blocks.get_block_ids(),
            )
        params["do_remote_prefill"] = False  # a re-entry (second allocation) must not register again
        block_ids = tuple(blocks.get_block_ids()[0])
        missing = [
            k for k in ("remote_engine_id", "remote_host", "remote_port") if params.get(k) in (None, "")
        ]
        if missing:
            self.meta.fail_recv.append((rid, f"kv_transfer_params lack {', '.join(missing)}"))
            self.recving[rid] = block_ids
            return
        n_blocks = -(-int(request.num_prompt_tokens) // self.conn.block_size)
        item = RecvItem(
            rid,
            transfer_key(rid, params),
            block_ids[:n_blocks],
            int(request.num_prompt_tokens),
            str(params["remote_engine_id"]),
            str(params["remote_host"]),
            int(params["remote_port"]),
            int(params.get("tp_size") or 1),
            int(params.get("pp_size") or 1),
        )
        self.meta.expect.append(item)
        self.recving[rid] = block_ids

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self.meta = self.meta, KVPushConnectorMetadata()
        if _DEBUG and scheduler_output.num_scheduled_tokens:
            log.warning(
                "kvpush debug sched %s", {r: n for r, n in scheduler_output.num_scheduled_tokens.items()}
            )
        if self.prefill_reqs:
            mgr = self.conn._kv_cache_manager
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                req = self.prefill_reqs.get(rid)
                if req is None or rid in self.handed:
                    continue
                if req.num_computed_tokens + n < req.num_prompt_tokens:
                    continue  # a chunk; the prompt completes in a later step
                if mgr is None:
                    raise RuntimeError("KVPushConnector needs bind_kv_cache_manager (vLLM >= 0.32)")
                num_tokens = int(req.num_prompt_tokens)
                blocks = mgr.get_block_ids(rid)[0][: -(-num_tokens // self.conn.block_size)]
                meta.send.append(
                    SendItem(rid, transfer_key(rid, req.kv_transfer_params), tuple(blocks), num_tokens)
                )
                self.handed.add(rid)
        if self.waiter is not None:
            meta.wake_path = self.waiter.path
            if (
                not scheduler_output.total_num_scheduled_tokens
                and not meta.has_commands()
                and (self.recving or self.sending or self.handed)
            ):
                # Nothing to compute, nothing to tell the worker: only transfers are outstanding.
                # Sleep until one settles (the transfer thread wakes us) or idle_wait_ms passes.
                self.waiter.wait(self.idle_wait_s)
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params or {}
        if self.conn.is_producer and (rid in self.prefill_reqs or params.get("do_remote_decode")):
            req = self.prefill_reqs.pop(rid, request)
            key = transfer_key(rid, req.kv_transfer_params)
            ok_status = request.status in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            )
            if rid not in self.handed:
                # Never handed over (aborted before its prompt completed): a decode that registered
                # already is told at once instead of waiting for the lease to run out.
                self.meta.abort_send.append((rid, key))
                return False, None
            self.handed.discard(rid)
            if not ok_status:
                self.meta.abort_send.append((rid, key))
            self.sending.add(rid)
            host, port = self.conn.config.host, self.conn.config.port
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_mode": "push",
                "remote_engine_id": self.conn.config.engine_id,
                "remote_request_id": key,
                "remote_host": host,
                "remote_port": port,
                "tp_size": self.conn.tp_size,
                "pp_size": self.conn.pp_size,
            }
        if rid in self.recving:
            # Finished (aborted, or failed by policy) before its KV was reported: keep the blocks until
            # the endpoint confirms that no WRITE can still land in them, then finished_recving frees them.
            self.meta.abort_recv.append(rid)
            return True, None
        if self.conn.is_consumer and params.get("do_remote_prefill") and params.get("remote_engine_id"):
            # Dropped while still waiting for blocks: nothing of ours to hold, but the prefill may be
            # holding its KV for us; tell it now instead of letting its lease run out.
            self.meta.cancel_recv.append(
                (
                    transfer_key(rid, params),
                    str(params["remote_engine_id"]),
                    str(params.get("remote_host") or ""),
                    int(params.get("remote_port") or 0),
                    int(params.get("tp_size") or 1),
                    int(params.get("pp_size") or 1),
                )
            )
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_sending or ():
            self.sending.discard(rid)
        for rid in connector_output.finished_recving or ():
            self.recving.pop(rid, None)
            if _DEBUG:
                log.warning("kvpush debug finished_recving %s", rid)

    def has_pending_work(self) -> bool:
        m = self.meta
        return bool(
            self.sending
            or self.handed
            or m.send
            or m.abort_send
            or m.expect
            or m.abort_recv
            or m.fail_recv
            or m.cancel_recv
        )


# ======================================================================================================
# worker side
# ======================================================================================================
class _Worker:
    def __init__(self, conn: KVPushConnector, vllm_config: VllmConfig):
        self.conn = conn
        self.vllm_config = vllm_config
        self.endpoint: Any = None
        self.layout: Any = None
        self.ratio = 1
        self.rank = 0
        self.mem_type = "DRAM"
        self.whole_blocks = False
        self.kv_caches: dict[str, Any] = {}
        self.lock = threading.Lock()
        # prefill
        self.key_to_req: dict[str, str] = {}
        self.send_done: dict[str, Any] = {}
        self.finished_seen: set[str] = set()
        self.handed_at: dict[str, float] = {}
        # decode
        self.recv_key_to_req: dict[str, str] = {}
        self.recv_blocks: dict[str, tuple[int, ...]] = {}
        self.recv_tokens: dict[str, int] = {}
        self.expect_at: dict[str, float] = {}
        self.aborted_recv: set[str] = set()
        self.instant_fail: list[tuple[str, str]] = []
        self.legacy_failed: set[str] = set()
        self.legacy_failed_blocks: set[int] = set()
        # metrics for tests and the benchmark
        self.stats: dict[str, Any] = {
            "handoffs": 0,
            "expects": 0,
            "sent_ok": 0,
            "sent_failed": 0,
            "recv_ok": 0,
            "recv_failed": 0,
            "recv_bytes": 0,
            "send_bytes": 0,
            "ready_s": [],
            "push_s": [],
        }
        self._stats_written = 0.0
        self._stats_stop = threading.Event()
        self.waker: IdleWaker | None = None

    # ---- set-up ------------------------------------------------------------------------------
    def _model_tag(self) -> str:
        mc = self.vllm_config.model_config
        hf = mc.hf_config
        arch = ",".join(getattr(hf, "architectures", None) or [])
        tag = (
            f"{arch}|layers={getattr(hf, 'num_hidden_layers', '?')}|hidden={getattr(hf, 'hidden_size', '?')}"
            f"|vocab={getattr(hf, 'vocab_size', '?')}|dtype={mc.dtype}"
        )
        user = self.conn.own.get("model_tag")
        return f"{tag}|{user}" if user else tag

    def _backend_name(self, kv_caches: dict[str, Any]) -> str:
        """The attention backend decides how a block's bytes are read; ask the first layer."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        layer = ctx.get(next(iter(kv_caches)))
        try:
            return str(layer.get_attn_backend().get_name())  # type: ignore[union-attr]
        except AttributeError:
            return "CPU_ATTN" if next(iter(kv_caches.values())).device.type == "cpu" else ""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint

        from .layout_probe import layout_from_kv_caches

        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except (ImportError, AssertionError, RuntimeError):
            self.rank = 0
        mc = self.vllm_config.model_config
        self.kv_caches = kv_caches
        backend = self._backend_name(kv_caches)
        # vLLM's CPU kernels keep tokens inside a block in their own packed order, so a partial block
        # cannot be cut by token: move whole blocks (block sizes must then match; the tag checks it).
        self.whole_blocks = backend == "CPU_ATTN"
        tag = self._model_tag() + (f"|whole-blocks={self.conn.block_size}" if self.whole_blocks else "")
        self.layout, self.ratio = layout_from_kv_caches(
            kv_caches,
            block_size=self.conn.block_size,
            total_kv_heads=int(mc.get_total_num_kv_heads()),
            tp_rank=self.rank,
            tp_size=self.conn.tp_size,
            model_tag=tag,
            split_content=backend == "CPU_ATTN",
        )
        first = next(iter(kv_caches.values()))
        mem_type = self.mem_type = "DRAM" if first.device.type == "cpu" else "VRAM"
        log.warning(
            "kvpush: %s rank %d %s compat %s (%d layers, %d KV heads x %d, block %d tokens, %d B/block, "
            "%s, %d kernel blocks per vLLM block of %d)",
            "prefill" if self.conn.is_producer else "decode",
            self.rank,
            mem_type,
            self.layout.compat_hash(),
            self.layout.num_layers,
            self.layout.num_kv_heads,
            self.layout.head_dim,
            self.layout.block_size,
            self.layout.block_bytes,
            self.layout.token_order,
            self.ratio,
            self.conn.block_size,
        )
        cls = PrefillEndpoint if self.conn.is_producer else DecodeEndpoint
        self.endpoint = cls(self.conn.config, self.layout, mem_type)
        self.endpoint.start()
        if self.conn.is_consumer:
            timeout = float(self.conn.own.get("connect_timeout_s", 120.0))
            for addr in self.conn.own.get("prefill_addresses") or ():
                pa = PrefillAddress(
                    str(addr["engine_id"]),
                    str(addr.get("host", "127.0.0.1")),
                    int(addr["port"]),
                    int(addr.get("tp_size", 1)),
                    int(addr.get("pp_size", 1)),
                )
                try:
                    self.endpoint.connect(pa, timeout)
                except LayoutError as exc:
                    self.endpoint.close()
                    raise LayoutError(
                        f"kvpush: this decode engine cannot receive KV from prefill {pa.engine_id!r} at "
                        f"{pa.host}:{pa.port}: {exc}. Start both engines with the same model, dtype and KV "
                        "cache layout."
                    ) from exc
        self._write_stats(force=True)
        if self.conn.own.get("stats_dir"):
            # An idle engine does not step; keep the file current from a tiny thread of our own.
            self._stats_stop = threading.Event()
            threading.Thread(target=self._stats_loop, name="kvpush-stats", daemon=True).start()

    def _stats_loop(self) -> None:
        while not self._stats_stop.wait(0.5):
            try:
                self._write_stats(force=True)
            except RuntimeError:  # a dict changed while copied; the next round gets it
                continue

    # ---- per step ----------------------------------------------------------------------------
    def start_step(self, meta: KVPushConnectorMetadata) -> None:
        if self.endpoint is None:
            return
        from kvpush.endpoint import PrefillAddress

        if meta.wake_path and (self.waker is None or self.waker.path != meta.wake_path):
            self.waker = IdleWaker(meta.wake_path)
            self.endpoint.set_result_listener(self.waker.wake)
        now = time.monotonic()
        for it in meta.expect:
            self.recv_key_to_req[it.key] = it.req_id
            self.recv_blocks[it.req_id] = it.block_ids
            self.recv_tokens[it.req_id] = it.num_tokens
            self.expect_at[it.req_id] = now
            self.stats["expects"] += 1
            self.endpoint.expect(
                it.key,
                expand_blocks(it.block_ids, self.ratio),
                self._span(it.num_tokens),
                PrefillAddress(it.engine_id, it.host, it.port, it.tp_size, it.pp_size),
            )
        for rid, reason in meta.fail_recv:
            self.instant_fail.append((rid, reason))
        for rid in meta.abort_recv:
            key = next((k for k, r in self.recv_key_to_req.items() if r == rid), None)
            if key is not None:
                self.aborted_recv.add(rid)
                self.endpoint.abort(key, "request aborted on decode")
        for key, engine_id, host, port, tp, pp in meta.cancel_recv:
            if host and port:
                self.endpoint.cancel(
                    key,
                    PrefillAddress(engine_id, host, port, tp, pp),
                    "request dropped on decode before its blocks were allocated",
                )

    def end_step(self, meta: KVPushConnectorMetadata) -> None:
        """After the forward pass: the prompt KV of meta.send is in memory now; hand it over."""
        if self.endpoint is None or not (meta.send or meta.abort_send):
            return
        if meta.send:
            self._sync_device()
        now = time.monotonic()
        for it in meta.send:
            self.key_to_req[it.key] = it.req_id
            self.handed_at[it.req_id] = now
            self.stats["handoffs"] += 1
            self.endpoint.prefill_done(
                it.key, expand_blocks(it.block_ids, self.ratio), self._span(it.num_tokens)
            )
            if _DEBUG:
                log.warning(
                    "kvpush debug P %s blocks %s sums %s",
                    it.key,
                    it.block_ids,
                    self._checksum(expand_blocks(it.block_ids, self.ratio), it.num_tokens),
                )
        for _rid, key in meta.abort_send:
            self.endpoint.abort(key, "request aborted on prefill")

    def _span(self, num_tokens: int) -> int:
        """Tokens to move: the prompt, or whole blocks when the backend's block interior is opaque."""
        if not self.whole_blocks:
            return num_tokens
        bs = self.layout.block_size
        return -(-num_tokens // bs) * bs

    def _sync_device(self) -> None:
        """Device KV is written by kernels on a stream: make sure they finished before the WRITE."""
        if self.mem_type != "DRAM":
            import torch

            torch.cuda.current_stream().synchronize()

    def collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.endpoint is None:
            return sending, recving, failed
        now = time.monotonic()
        if self.conn.is_producer:
            for fid in finished_req_ids:
                if fid in self.handed_at or fid in self.send_done:
                    self.finished_seen.add(fid)
            for r in self.endpoint.finished():
                rid = self.key_to_req.pop(r.request_id, None)
                if rid is None:
                    continue  # a registration-only request (never handed over) that ended
                self.send_done[rid] = r
                started = self.handed_at.pop(rid, None)
                if r.ok:
                    self.stats["sent_ok"] += 1
                    self.stats["send_bytes"] += r.nbytes
                    if started is not None:
                        self.stats["push_s"].append(round(r.done_at - started, 6))
                else:
                    self.stats["sent_failed"] += 1
                    log.warning("kvpush: push of %s failed: %s", rid, r.reason)
            for rid in list(self.send_done):
                if rid in self.finished_seen:
                    sending.add(rid)
                    del self.send_done[rid]
                    self.finished_seen.discard(rid)
        else:
            for rid, reason in self.instant_fail:
                recving.add(rid)
                failed.add(rid)
                self.stats["recv_failed"] += 1
                log.warning("kvpush: request %s cannot receive KV: %s", rid, reason)
            self.instant_fail.clear()
            for r in self.endpoint.finished():
                rid = self.recv_key_to_req.pop(r.request_id, None)
                if rid is None:
                    continue
                recving.add(rid)
                started = self.expect_at.pop(rid, None)
                blocks = self.recv_blocks.pop(rid, ())
                aborted = rid in self.aborted_recv
                self.aborted_recv.discard(rid)
                if _DEBUG:
                    log.warning(
                        "kvpush debug D %s ok=%s blocks %s sums %s",
                        r.request_id,
                        r.ok,
                        blocks,
                        self._checksum(expand_blocks(blocks, self.ratio), self.recv_tokens.get(rid, 0)),
                    )
                if r.ok:
                    self.stats["recv_ok"] += 1
                    self.stats["recv_bytes"] += r.nbytes
                    if started is not None:
                        self.stats["ready_s"].append(round(r.ready_at - started, 6))
                else:
                    self.stats["recv_failed"] += 1
                    if not aborted:
                        failed.add(rid)
                        self.legacy_failed_blocks.update(blocks)
                        log.warning("kvpush: KV for %s did not arrive: %s", rid, r.reason)
        self._write_stats(now=now)
        return sending, recving, failed

    def _checksum(self, blocks: list[int], n: int) -> list[float]:
        out = []
        bs = self.layout.block_size
        for name in list(self.kv_caches)[:1] + list(self.kv_caches)[-1:]:
            t = self.kv_caches[name]
            tot = 0.0
            for i, b in enumerate(blocks):
                k = min(bs, n - i * bs)
                if k <= 0:
                    break
                tot += (
                    float(t[b][:, :k].double().sum()) if t.dim() == 4 else float(t[:, b, :k].double().sum())
                )
            out.append(round(tot, 4))
        return out

    def take_legacy_failed_blocks(self) -> set[int]:
        if KVConnectorTransferResults is not None:
            self.legacy_failed_blocks.clear()
            return set()
        out, self.legacy_failed_blocks = self.legacy_failed_blocks, set()
        return out

    # ---- stats -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.items()}
        out["role"] = "prefill" if self.conn.is_producer else "decode"
        out["engine_id"] = self.conn.config.engine_id
        out["rank"] = self.rank
        out["pid"] = os.getpid()
        out["time"] = time.time()
        # kvpush's own threads in this process (the benchmark measures their idle CPU from /proc)
        out["threads"] = {
            t.name: t.native_id
            for t in threading.enumerate()
            if t.name.startswith("kvpush") and t.native_id is not None
        }
        if self.layout is not None:
            out["compat"] = self.layout.compat_hash()
            out["bytes_per_token"] = self.layout.bytes_per_token
        if self.endpoint is not None:
            with contextlib.suppress(AttributeError, RuntimeError):
                out["endpoint"] = self.endpoint.stats()
            ep = out.get("endpoint", {})
            out["order_counts"] = {k: ep[k] for k in ("registration_first", "prefill_first") if k in ep}
            out["pending"] = ep.get("pending")
        out["outstanding"] = len(self.handed_at) + len(self.send_done) + len(self.recv_key_to_req)
        return out

    def _write_stats(self, now: float | None = None, force: bool = False) -> None:
        stats_dir = self.conn.own.get("stats_dir")
        if not stats_dir:
            return
        now = time.monotonic() if now is None else now
        if not force and now - self._stats_written < 0.25:
            return
        self._stats_written = now
        path = Path(stats_dir) / f"{self.conn.config.engine_id}-rank{self.rank}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.snapshot()))
            tmp.replace(path)
        except OSError as exc:
            log.warning("kvpush: cannot write stats to %s: %s", path, exc)

    def shutdown(self) -> None:
        self._stats_stop.set()
        if self.endpoint is not None:
            self._write_stats(force=True)
            self.endpoint.close()  # stops the transfer thread, the only user of the waker's socket
            self.endpoint = None
        if self.waker is not None:
            self.waker.close()
            self.waker = None
