"""The prefill engine's worker side: hand each finished prompt's blocks to kvpush's push thread.

One `_Push` record per request, from hand-off (wait_for_save of the step that computed the prompt's last
KV) until vLLM may free the blocks: the WRITE finished or failed (the endpoint's result) AND the scheduler
has reported the request finished (finished_req_ids). Only then is it in finished_sending.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush.endpoint import PrefillEndpoint, SendResult
from kvpush.errors import LayoutError

from .block_table import GroupIds, expand_group_ids, first_table
from .layer_groups import LayerGroups
from .overdue import Held, OverdueCheck
from .probe import debug_checksums
from .scheduler import KVPushConnectorMetadata, SendItem
from .worker_common import WorkerBase

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .params import ConnectorSettings

log = logging.getLogger("kvpush.vllm")

# beyond the protocol's own bound: the transfer thread's tick and one engine step
OVERDUE_SLACK_S = 2.0


@dataclass
class _Push:
    req_id: str  # vLLM's internal id
    key: str  # the transfer key both engines agree on
    handed_at: float
    result: SendResult | None = None  # set once the push thread is done with the blocks
    finished_in_vllm: bool = False  # the scheduler reported it finished (its blocks wait for us)


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig) -> None:
        super().__init__(settings, vllm_config)
        self.endpoint: PrefillEndpoint | None = None
        self.by_req: dict[str, _Push] = {}
        self.by_key: dict[str, _Push] = {}
        self.handoffs = 0
        self.named = 0  # prompts named before their forward pass (source_blocks)
        self.sent_ok = 0
        self.sent_failed = 0
        self.send_bytes = 0
        self.push_s: list[float] = []
        # layer-group push (settings.stream_layers): this step's prompts, as (item, expanded blocks)
        self.groups: LayerGroups | None = None
        self.layer_ranges = 0  # kv_ready calls made from save_kv_layer
        self.layer_calls = 0  # save_kv_layer calls while a step had prompts to report
        self._step: list[tuple[SendItem, GroupIds]] = []
        self._step_meta: KVPushConnectorMetadata | None = None  # the step _step was made for
        self._layered: set[str] = set()  # keys given a layer range and no terminal call yet
        self._cut: set[str] = set()  # of those, the aborted ones: no more ranges (vLLM may reuse the blocks)
        leases = settings.config.leases
        # the longest the protocol lets the push thread keep a handed-over prompt: its lease (waiting for
        # the registration), then a WRITE to its timeout and linger, plus a moment to reach an engine step
        self.overdue = OverdueCheck("prefill", leases.lease_s + leases.write_bound_s + OVERDUE_SLACK_S)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        cache = self.probe(kv_caches)
        self.endpoint = PrefillEndpoint(
            self.settings.config,
            cache.layout,
            cache.mem_type,
            hooks=cache.setup.hooks,  # type: ignore[arg-type]  # a TransferHooks when staged
        )
        self.endpoint.start()
        if self.settings.stream_layers > 0:
            self.groups = LayerGroups(list(kv_caches), self.settings.stream_layers)
        self.start_stats()

    def start_step(self, meta: KVPushConnectorMetadata) -> None:
        if self.endpoint is not None:
            self.bind_waker(meta.wake_path, self.endpoint)

    def name_sources(self, meta: KVPushConnectorMetadata) -> None:
        """Before the forward pass: the prompts this step completes (meta.send) are named to the endpoint
        with the blocks end_step will hand over (source_blocks), so a registered decode's WRITE is planned
        and made while the model computes; prefill_done then only posts it. A table kvpush refuses is left
        to prefill_done, which says why."""
        if not self.settings.arm_writes or self.endpoint is None or self.cache is None or not meta.send:
            return
        skip = {key for _rid, key in meta.abort_send}
        for it in meta.send:
            if it.key in skip or it.key in self.by_key:
                continue
            try:
                self.endpoint.source_blocks(
                    it.key,
                    expand_group_ids(it.block_ids, self.cache.ratio),
                    it.num_tokens,
                    decode_engine_id=it.decode_engine_id,
                )
            except LayoutError:
                continue
            self.named += 1

    def _begin_layers(self, meta: KVPushConnectorMetadata) -> None:
        """The first save_kv_layer of a step: which prompts its layer groups report. (Here, not in
        start_load_kv: vLLM >= 0.32 calls that after the forward pass unless the step loads KV.)"""
        self._step_meta = meta
        self._step = []
        if self.groups is None or self.cache is None or not (meta.ready or meta.send):
            return
        # a request aborted in this step (preempted: vLLM may have given its blocks out again) or earlier
        # gets no range; its abort is issued in end_step, before its terminal call
        skip = self._cut | {key for _rid, key in meta.abort_send}
        self._step = [  # layer groups stream one KV-cache group (a flat table): kv_ready refuses others
            (it, expand_group_ids(it.block_ids, self.cache.ratio))
            for it in (*meta.ready, *meta.send)
            if it.key not in skip and it.block_ids and isinstance(it.block_ids[0], int)
        ]
        self.groups.reset()

    def save_kv_layer(self, meta: KVPushConnectorMetadata, layer_name: str) -> None:
        """An attention layer of this step's forward pass has written its KV: once that completes a layer
        group, every prompt computed in this step reports the group ready, with its own barrier."""
        if meta is not self._step_meta:
            self._begin_layers(meta)
        if not self._step or self.groups is None or self.endpoint is None or self.cache is None:
            return
        self.layer_calls += 1
        if layer_name not in self.groups.index and self.layer_calls == 1:
            log.warning("kvpush: save_kv_layer for %r, a layer not among the KV caches", layer_name)
        layers = self.groups.saved(layer_name)
        if layers is None:
            return
        barrier = self.cache.kv_written_barrier()
        for it, blocks in self._step:
            self.endpoint.kv_ready(
                it.key,
                blocks,
                it.num_tokens,
                layers=layers,
                kv_written=barrier,
                decode_engine_id=it.decode_engine_id,
            )
            self._layered.add(it.key)
            self.layer_ranges += 1

    def end_step(self, meta: KVPushConnectorMetadata) -> None:
        """After the forward pass: the KV this step computed is in memory now; hand it over (whole prompts
        in meta.send, streamed chunks in meta.ready)."""
        self._step, self._step_meta = [], None
        if self.endpoint is None or self.cache is None or not (meta.send or meta.abort_send or meta.ready):
            return
        # Device kernels write the KV on a stream: the backend records a marker here (CUDA: an event on
        # the current stream; host: nothing) and the push thread waits on it before reading the blocks.
        # One marker covers every request of this step; nothing on this thread waits for the device.
        barrier = self.cache.kv_written_barrier() if (meta.send or meta.ready) else None
        now = time.monotonic()
        # aborts first: a request preempted mid-stream is aborted before its prefill_done in this step
        for _rid, key in meta.abort_send:
            self.endpoint.abort(key, "request aborted on prefill")
            if key in self._layered:
                self._cut.add(key)
        for it in meta.ready:
            self.endpoint.kv_ready(
                it.key,
                expand_group_ids(it.block_ids, self.cache.ratio),
                it.num_tokens,
                kv_written=barrier,
                decode_engine_id=it.decode_engine_id,
            )
        for it in [*meta.stop, *meta.send]:  # stop: aborted mid-stream, ended by its terminal call
            self._hand(it, now, barrier)
            self._layered.discard(it.key)
            self._cut.discard(it.key)
        self.publish_stats(news=True)

    def _hand(self, it: SendItem, now: float, barrier: Callable[[], None] | None) -> None:
        rec = _Push(it.req_id, it.key, now)
        self.by_req[it.req_id] = rec
        if it.key in self.by_key:
            # The scheduler refuses colliding keys; should one still get here, fail it alone
            # rather than let the endpoint treat it as the live request's resend.
            rec.result = SendResult(it.key, False, (), f"transfer key {it.key!r} is in use")
            return
        assert self.endpoint is not None and self.cache is not None
        blocks = expand_group_ids(it.block_ids, self.cache.ratio)
        try:
            self.endpoint.prefill_done(
                it.key, blocks, it.num_tokens, kv_written=barrier, decode_engine_id=it.decode_engine_id
            )
        except LayoutError as exc:  # a table kvpush cannot read: this push fails, the engine goes on
            rec.result = SendResult(it.key, False, (), str(exc))
            self.sent_failed += 1
            log.warning("kvpush: push of %s refused: %s", it.req_id, exc)
            return
        self.by_key[it.key] = rec
        self.handoffs += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvpush P %s blocks %s sums %s",
                it.key,
                it.block_ids,
                debug_checksums(
                    self.kv_caches, first_table(blocks), it.num_tokens, self.cache.layout.block_size
                ),
            )

    def collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        sending: set[str] = set()
        if self.endpoint is None:
            return sending, set(), set()
        news = False
        for rid in finished_req_ids:
            rec = self.by_req.get(rid)
            if rec is not None:
                rec.finished_in_vllm = True
        for r in self.endpoint.finished():
            rec = self.by_key.pop(r.request_id, None)
            if rec is None:
                continue  # a registration-only request (never handed over) that ended
            news = True
            rec.result = r
            if r.ok:
                self.sent_ok += 1
                self.send_bytes += r.nbytes
                self.push_s.append(round(r.done_at - rec.handed_at, 6))
            else:
                self.sent_failed += 1
                log.warning("kvpush: push of %s failed: %s", rec.req_id, r.reason)
        for rid, rec in list(self.by_req.items()):
            if rec.result is not None and rec.finished_in_vllm:
                sending.add(rid)
                del self.by_req[rid]
                news = True
        self.check_overdue(time.monotonic())
        self.publish_stats(news)
        return sending, set(), set()

    def check_overdue(self, now: float) -> list[Held]:
        """Name every prompt the push thread still holds past its bound (rate limited; see overdue.py).
        A request whose push is over but which vLLM is still running (generating on the prefill) is
        vLLM's to finish, not held by kvpush, and is not counted."""
        if not self.by_key or not self.overdue.due(now):
            return []
        endpoint = self.endpoint
        held = [
            Held(
                rec.key,
                rec.req_id,
                rec.handed_at,
                ("finished in vLLM" if rec.finished_in_vllm else "still running in vLLM")
                + f"; endpoint: {endpoint.describe(rec.key) if endpoint is not None else 'closed'}",
            )
            for rec in self.by_key.values()
        ]
        return self.overdue.check(held, now)

    # ---- stats -------------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        return {
            "handoffs": self.handoffs,
            "named": self.named,
            "sent_ok": self.sent_ok,
            "sent_failed": self.sent_failed,
            "send_bytes": self.send_bytes,
            "push_s": list(self.push_s),
            "layer_ranges": self.layer_ranges,
            "layer_calls": self.layer_calls,
        }

    def outstanding(self) -> int:
        return len(self.by_req)

    def endpoint_stats(self) -> dict[str, int]:
        return self.endpoint.stats() if self.endpoint is not None else {}

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.close_stats()
            self.endpoint.close()  # stops the transfer thread, the only user of the waker's socket
            self.endpoint = None
        self.close_waker()
