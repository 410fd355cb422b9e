"""The two emulated engines (one process each); their connectors are one strategy per mode.

Each engine runs a main loop that advances in steps like vLLM's EngineCore: schedule (admit, allocate,
connector hooks), compute (sleep for the cost model's step time), then process outputs (connector
completion polls, finished requests). Connectors (steps.PrefillConnector / DecodeConnector):

push           kvpush.endpoint (push.py).
pull           vLLM NixlConnector, emulated (pull.py): decode READs what the prefill computed.
pull-threaded  the same, with descriptor building and posting moved to a background thread.

Both modes add the modelled NIC posting time and the wire time of the real (unscaled) bytes on a serial
link, never the loopback copy. The environment (UCX on loopback, NIXL's log level) is set by the entry
point, `kvpush bench`, before it spawns the engines. See docs/bench.md.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections import deque
from typing import Any

from kvpush.apps.bench.steps import PULL_THREADED, PUSH, DecodeConnector, PrefillConnector, Req, sleep_until
from kvpush.protocol.layout import blocks_for


def _debug_logging() -> None:
    """KVPUSH_BENCH_DEBUG=1: the core's per-request timings (queued/plan/post/complete) on stderr."""
    if os.environ.get("KVPUSH_BENCH_DEBUG"):
        import logging

        logging.basicConfig(
            level=logging.WARNING, format="%(relativeCreated)9.1f %(processName)s %(message)s"
        )
        logging.getLogger("kvpush").setLevel(logging.DEBUG)


_parent_checked = 0.0


def _orphaned() -> bool:
    """True once the bench process is gone (checked at most once a second, from idle loops only), so
    an interrupted run does not leave engines holding their ports and memory."""
    global _parent_checked
    now = time.monotonic()
    if now - _parent_checked < 1.0:
        return False
    _parent_checked = now
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


# ====================================================================================================
# prefill engine
# ====================================================================================================
def prefill_main(mode: str, cm_path: Any, inbox: Any, outbox: Any, acct: Any, port: int) -> None:
    try:
        _debug_logging()
        _PrefillEngine(mode, cm_path, inbox, outbox, acct, port).run()
    except Exception:  # noqa: BLE001 - any failure is surfaced to the router, which stops the run
        outbox.put({"type": "error", "role": "prefill", "mode": mode, "trace": traceback.format_exc()})


class _PrefillEngine:
    def __init__(self, mode: str, cm_path: Any, inbox: Any, outbox: Any, acct: Any, port: int):
        from kvpush.apps.bench.costmodel import CostModel
        from kvpush.backends.host import HostKVCache

        self.mode, self.inbox, self.outbox, self.acct = mode, inbox, outbox, acct
        self.cm = CostModel.from_spec(cm_path)
        self.cache = HostKVCache(self.cm.layout("prefill"))
        self.cache.buffer.fill(1)  # fault the pages in now, not during the first transfers
        self.layout = self.cache.layout
        self.pool = self.cm.aged_pool("prefill")
        self.port = port
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.held: dict[str, Req] = {}  # finished prefill, blocks kept until sent / read
        self.stop = threading.Event()
        self.connector = self._connector(mode)

    def _connector(self, mode: str) -> PrefillConnector:
        if mode == PUSH:
            from kvpush.apps.bench.push import PushPrefill

            return PushPrefill(self)
        from kvpush.apps.bench.pull import PullPrefill

        return PullPrefill(self)

    def run(self) -> None:  # noqa: C901
        info = self.connector.start()
        self.outbox.put({"type": "ready", "role": "prefill", "mode": self.mode, **info})
        cm = self.cm
        while True:
            # ---- schedule ------------------------------------------------------------------------
            busy = bool(self.running or self.waiting)
            try:
                while True:
                    if busy:
                        msg = self.inbox.get_nowait()
                    else:
                        msg = self.inbox.get(timeout=(0.001 if self.held else 0.05))
                    busy = True
                    if msg["type"] == "stop":
                        self._close()
                        return
                    if msg["type"] == "req":
                        r = Req(msg["id"], msg["prompt_len"], msg["output_len"], msg["arrival"])
                        r.stats["prefill_recv"] = time.monotonic()
                        self.waiting.append(r)
            except queue.Empty:
                if not busy and _orphaned():
                    self._close()
                    return
            self.connector.poll_freed()
            # vLLM Scheduler.schedule with chunked prefill: running requests first, then waiting ones
            # (FCFS); KVCacheManager.allocate_slots gives each request the blocks of *this step's*
            # chunk, so a long prompt's blocks come from the free queue in pieces, interleaved with
            # the other requests scheduled in the same steps.
            budget = cm.prefill_budget
            bs = self.layout.block_size
            chunks: list[tuple[Req, int]] = []
            for r in self.running:
                if budget <= 0:
                    break
                n = min(budget, r.prompt_len - r.computed)
                need = blocks_for(r.computed + n, bs) - len(r.blocks)
                if not self.pool.can_allocate(need):
                    continue  # vLLM would preempt; with a real-size pool this does not happen
                r.blocks += self.pool.allocate(need)
                chunks.append((r, n))
                budget -= n
            while self.waiting and budget > 0 and len(self.running) < cm.prefill_max_seqs:
                r = self.waiting[0]
                n = min(budget, r.prompt_len)
                need = blocks_for(n, bs)
                if not self.pool.can_allocate(need):
                    break
                self.waiting.popleft()
                r.blocks = self.pool.allocate(need)
                r.stats["prefill_start"] = time.monotonic()
                self.running.append(r)
                chunks.append((r, n))
                budget -= n
            if not chunks:
                if self.waiting:
                    time.sleep(0.0005)  # out of blocks: wait for frees without spinning a core
                continue
            # ---- compute -------------------------------------------------------------------------
            t0 = time.monotonic()
            sleep_until(t0 + cm.prefill_step_s([(r.computed, n) for r, n in chunks]))
            # ---- outputs -------------------------------------------------------------------------
            done_now = []
            for r, n in chunks:
                r.computed += n
                if r.computed >= r.prompt_len:
                    done_now.append(r)
            for r in done_now:
                self.running.remove(r)
                now = time.monotonic()
                r.stats["prefill_done"] = now
                self.held[r.id] = r
                self.connector.on_prefill_done(r)

    def _close(self) -> None:
        self.stop.set()
        self.connector.close()


# ====================================================================================================
# decode engine
# ====================================================================================================
def decode_main(
    mode: str, cm_path: Any, inbox: Any, outbox: Any, acct: Any, prefill_info: dict[str, Any]
) -> None:
    try:
        _debug_logging()
        _DecodeEngine(mode, cm_path, inbox, outbox, acct, prefill_info).run()
    except Exception:  # noqa: BLE001 - any failure is surfaced to the router, which stops the run
        outbox.put({"type": "error", "role": "decode", "mode": mode, "trace": traceback.format_exc()})


class _DecodeEngine:
    def __init__(
        self, mode: str, cm_path: Any, inbox: Any, outbox: Any, acct: Any, prefill_info: dict[str, Any]
    ):
        from kvpush.apps.bench.costmodel import CostModel
        from kvpush.backends.host import HostKVCache

        self.mode, self.inbox, self.outbox, self.acct = mode, inbox, outbox, acct
        self.cm = CostModel.from_spec(cm_path)
        self.cache = HostKVCache(self.cm.layout("decode"))
        self.cache.buffer.fill(0)
        self.layout = self.cache.layout
        self.pool = self.cm.aged_pool("decode")
        self.prefill_info = prefill_info
        self.new: deque[Req] = deque()  # arrived, not yet allocated
        self.waiting_kv: dict[str, Req] = {}  # allocated, KV not ready (WAITING_FOR_REMOTE_KVS)
        self.ready: deque[Req] = deque()  # KV ready, waiting for a running slot
        self.running: list[Req] = []
        self.connector = self._connector(mode)

    def _connector(self, mode: str) -> DecodeConnector:
        if mode == PUSH:
            from kvpush.apps.bench.push import PushDecode

            return PushDecode(self)
        from kvpush.apps.bench.pull import PullDecode

        return PullDecode(self, threaded=mode == PULL_THREADED)

    def _on_alloc(self, r: Req) -> None:
        r.stats["decode_alloc"] = time.monotonic()
        self.connector.on_alloc(r)

    # ---- main loop -----------------------------------------------------------------------------------
    def run(self) -> None:  # noqa: C901
        self.connector.start()
        self.outbox.put({"type": "ready", "role": "decode", "mode": self.mode})
        cm, bs = self.cm, self.layout.block_size
        while True:
            active = bool(self.running or self.waiting_kv or self.ready or self.new)
            try:
                while True:
                    msg = (
                        self.inbox.get(timeout=(0.0005 if active else 0.05))
                        if not active
                        else self.inbox.get_nowait()
                    )
                    if msg["type"] == "stop":
                        self._close()
                        return
                    if msg["type"] == "stats":
                        self.outbox.put(
                            {"type": "decode_stats", "loop_charged_s": self.connector.loop_charged_s}
                        )
                        continue
                    r = Req(
                        msg["id"], msg["prompt_len"], msg["output_len"], msg["arrival"], msg.get("kv_params")
                    )
                    r.stats["decode_recv"] = time.monotonic()
                    self.new.append(r)
                    active = True
            except queue.Empty:
                if not active and _orphaned():
                    self._close()
                    return
            if not active:
                continue
            # ---- schedule (vLLM Scheduler.schedule) -----------------------------------------------
            while self.ready and len(self.running) < cm.decode_max_seqs:
                r = self.ready.popleft()
                r.stats["decode_first_sched"] = time.monotonic()
                self.running.append(r)
            while self.new and len(self.running) < cm.decode_max_seqs:
                r = self.new[0]
                # admit only if the whole request fits (vLLM would preempt later; a real-size pool never
                # gets there), but allocate like vLLM: the prompt's blocks now (allocate_slots with the
                # external tokens), one more block each time a generated token starts a new block
                if not self.pool.can_allocate(blocks_for(r.prompt_len + r.output_len, bs)):
                    break
                self.new.popleft()
                r.blocks = self.pool.allocate(blocks_for(r.prompt_len, bs))
                self.waiting_kv[r.id] = r
                self._on_alloc(r)
            # ---- execute_model: start_load_kv, forward, get_finished --------------------------------
            self.connector.start_load_kv()
            ctx = sum(r.prompt_len + len(r.tokens) for r in self.running)
            sleep_until(time.monotonic() + cm.decode_step_s(len(self.running), ctx))
            now = time.monotonic()
            finished_recving = self.connector.get_finished()
            # ---- update_from_output ----------------------------------------------------------------
            done = []
            for r in self.running:
                r.tokens.append(now)
                if len(r.tokens) >= r.output_len:
                    done.append(r)
                elif blocks_for(r.prompt_len + len(r.tokens) + 1, bs) > len(
                    r.blocks
                ) and self.pool.can_allocate(1):
                    r.blocks += self.pool.allocate(1)
            for r in done:
                self.running.remove(r)
                self.pool.free(r.blocks)
                self.outbox.put({"type": "done", "id": r.id, "tokens": r.tokens, "stats": r.stats})
            for rid in finished_recving:
                r = self.waiting_kv.pop(rid)
                r.stats["kv_ready_seen"] = now
                if "error" in r.stats:
                    self.pool.free(r.blocks)
                    self.outbox.put({"type": "done", "id": r.id, "tokens": [], "stats": r.stats})
                else:
                    self.ready.append(r)

    def _close(self) -> None:
        self.connector.close()
