"""The two emulated engines (one process each) and their connectors.

Each engine runs a main loop that advances in steps like vLLM's EngineCore: schedule (admit, allocate,
connector hooks), compute (sleep for the cost model's step time), then process outputs (connector
completion polls, finished requests). Connectors:

push           kvpush.endpoint: decode `expect()`s at allocation (vLLM: update_state_after_alloc), prefill
               calls `prefill_done()` the step a request finishes, both poll `finished()` each step.
pull           vLLM NixlConnector (pull_scheduler.py / pull_worker.py / base_worker.py): the router
               forwards the prefill's block ids; decode's start_load_kv (inside the engine step) handshakes
               in the background on first contact, builds descriptors and posts the READ; get_finished
               polls it each step; prefill frees its blocks when decode's notification arrives.
pull-threaded  the same, with descriptor building and posting moved to a background thread.

Loopback is not a NIC: UCX over cma copies inside the posting call. A NIC copies asynchronously but
keeps the posting thread busy for a per-descriptor time. So the posting *thread* is charged the cost
model's NIC posting time (post_cost_s), and the real NIXL call (which carries the loopback copy) runs on
an emulated-NIC thread. Copy time is measured there and reported, never charged to an engine loop.
Push gets the same model as a serial posting stage replayed after the core's ready_at, and both modes
add the wire time of the real (unscaled) bytes on a serial link. See docs/bench.md.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvpush.protocol.layout import blocks_for

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

PUSH, PULL, PULL_THREADED = "push", "pull", "pull-threaded"
MODES = (PUSH, PULL, PULL_THREADED)


def _debug_logging() -> None:
    """KVPUSH_BENCH_DEBUG=1: the core's per-request timings (queued/plan/post/complete) on stderr."""
    if os.environ.get("KVPUSH_BENCH_DEBUG"):
        import logging

        logging.basicConfig(
            level=logging.WARNING, format="%(relativeCreated)9.1f %(processName)s %(message)s"
        )
        logging.getLogger("kvpush").setLevel(logging.DEBUG)


def _new_transport(name: str) -> Any:
    """A NIXL transport that can also READ: the pull emulation needs it, the push core never does."""
    from kvpush.transport.base import Descs
    from kvpush.transport.nixl import NixlTransport, prepare_environment

    class _ReadingNixlTransport(NixlTransport):
        def post_read(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> Any:
            return self._post("READ", peer, local, remote, notif, mem_type)

    prepare_environment("lo")
    return _ReadingNixlTransport(name)


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


def _sleep_until(t: float) -> None:
    while True:
        d = t - time.monotonic()
        if d <= 0:
            return
        time.sleep(d)


# ====================================================================================================
# emulated NIC: runs the real NIXL transfers off the engine loops
# ====================================================================================================
@dataclass
class _NicJob:
    req_id: str
    peer: str
    local: Any
    remote: Any
    notif: bytes
    nbytes: int
    wire_s: float = 0.0  # what the real (unscaled) bytes take on the reference per-rank link
    done: bool = False
    error: str = ""
    posted_at: float = 0.0
    post_call_s: float = 0.0  # time inside the posting call (loopback: includes the cma copy)
    copy_done_at: float = 0.0  # the real loopback transfer completed
    done_at: float = 0.0  # + the modelled wire time on a serial link: when the KV is usable


class EmulatedNic(threading.Thread):
    """Posts READs and drives them to completion, as an RDMA NIC would do without the host loop.

    Completion = the real loopback transfer, then the reference link's wire time for the real
    (unscaled) bytes on a link that carries one transfer at a time (`done_at`); the decode loop treats a
    READ as finished only once `done_at` has passed.
    """

    def __init__(self, transport: Any) -> None:
        super().__init__(name="emulated-nic", daemon=True)
        self.transport = transport
        self.jobs: queue.SimpleQueue[_NicJob | None] = queue.SimpleQueue()
        self._link_free_at = 0.0

    def run(self) -> None:
        inflight: list[tuple[_NicJob, Any]] = []
        while True:
            try:
                job = self.jobs.get(timeout=0.05) if not inflight else self.jobs.get_nowait()
            except queue.Empty:
                job = None
            if job is not None:
                t0 = time.monotonic()
                try:
                    h = self.transport.post_read(job.peer, job.local, job.remote, job.notif, "DRAM")
                    job.posted_at, job.post_call_s = t0, time.monotonic() - t0
                    inflight.append((job, h))
                except Exception as exc:  # noqa: BLE001 - reported through the job
                    job.error, job.done = f"{type(exc).__name__}: {exc}", True
            keep = []
            for j, h in inflight:
                try:
                    if self.transport.poll(h) == "DONE":
                        j.copy_done_at = time.monotonic()
                        self.transport.release(h)
                        self._link_free_at = max(j.copy_done_at, self._link_free_at) + j.wire_s
                        j.done_at = self._link_free_at
                        j.done = True
                        continue
                except Exception as exc:  # noqa: BLE001
                    j.error, j.done = f"{type(exc).__name__}: {exc}", True
                    continue
                keep.append((j, h))
            inflight = keep
            if inflight:
                time.sleep(50e-6)


# ====================================================================================================
# side channel for the pull handshake (vLLM: _nixl_handshake_listener / _nixl_handshake over ZMQ)
# ====================================================================================================
def _serve_handshake(sock_addr: str, payload: dict[str, Any], stop: threading.Event) -> threading.Thread:
    import zmq

    def loop() -> None:
        ctx: Any = zmq.Context.instance()
        s = ctx.socket(zmq.REP)
        s.bind(sock_addr)
        s.setsockopt(zmq.RCVTIMEO, 100)
        while not stop.is_set():
            try:
                s.recv()
            except zmq.Again:
                continue
            s.send_pyobj(payload)
        s.close(0)

    t = threading.Thread(target=loop, name="pull-handshake-listener", daemon=True)
    t.start()
    return t


def _handshake(sock_addr: str) -> dict[str, Any]:
    import zmq

    ctx: Any = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect(sock_addr)
    s.send(b"get_meta")
    out = s.recv_pyobj()
    s.close(0)
    return out  # type: ignore[no-any-return]


# ====================================================================================================
# requests as the engines see them
# ====================================================================================================
@dataclass
class Req:
    id: str
    prompt_len: int
    output_len: int
    arrival: float
    kv_params: dict[str, Any] | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # prefill: prompt tokens computed
    tokens: list[float] = field(default_factory=list)  # decode: token timestamps
    stats: dict[str, Any] = field(default_factory=dict)


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

    def _start_connector(self) -> dict[str, Any]:
        if self.mode == PUSH:
            from kvpush.config import KVPushConfig
            from kvpush.endpoint import PrefillEndpoint

            cfg = KVPushConfig(engine_id=f"bench-prefill-{self.port}", port=self.port)
            self.endpoint = PrefillEndpoint(cfg, self.layout)
            self.endpoint.start()
            host, p = self.endpoint.address
            return {"engine_id": cfg.engine_id, "host": host, "port": p}
        self.transport = _new_transport(f"bench-pull-prefill-{self.port}")
        self.transport.register(self.layout.regions, "DRAM")
        addr = f"tcp://127.0.0.1:{self.port}"
        payload = {
            "metadata": self.transport.metadata(),
            "base_addr": self.layout.regions[0].addr,
            "engine_id": f"bench-prefill-{self.port}",
        }
        _serve_handshake(addr, payload, self.stop)
        self._notifs: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        threading.Thread(target=self._nixl_progress, name="nixl-progress", daemon=True).start()
        return {"engine_id": payload["engine_id"], "host": "127.0.0.1", "port": self.port}

    def _nixl_progress(self) -> None:
        """vLLM creates its NIXL agent with NIXL's progress thread on (nixl_agent_config defaults,
        vllm base_worker.py), and an RDMA READ needs nothing from its target. On loopback UCX a READ
        only completes while the target process progresses its worker, so the prefill side gets a
        progress thread, polled like kvpush's own workers (50 us while a READ is expected, 20 ms
        otherwise). Notifications it collects are handed to the engine loop, which reads them once
        per step as vLLM's _get_new_notifs does."""
        while not self.stop.is_set():
            for item in self.transport.drain_notifs():
                self._notifs.put(item)
            time.sleep(50e-6 if self.held else 0.02)

    def _poll_freed(self) -> None:
        """vLLM: get_finished() each step -> finished_sending -> blocks freed."""
        if self.mode == PUSH:
            for r in self.endpoint.finished():
                req = self.held.pop(r.request_id, None)
                if req is not None:
                    self.pool.free(req.blocks)
                    if not r.ok:
                        self.outbox.put({"type": "prefill_error", "id": r.request_id, "reason": r.reason})
            return
        while not self._notifs.empty():
            _peer, msg = self._notifs.get()
            req_id = msg.decode().rsplit(":", 1)[0]
            req = self.held.pop(req_id, None)
            if req is not None:
                self.pool.free(req.blocks)

    def run(self) -> None:
        info = self._start_connector()
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
            self._poll_freed()
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
            _sleep_until(t0 + cm.prefill_step_s([(r.computed, n) for r, n in chunks]))
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
                if self.mode == PUSH:
                    # kvpush: the blocks go to the push thread in the same step
                    self.endpoint.prefill_done(r.id, r.blocks, r.prompt_len)
                    self.acct.put((r.id, r.blocks))  # emulation-only: descriptor count for NIC post cost
                    self.outbox.put({"type": "prefill_done", "id": r.id, "stats": r.stats})
                else:
                    # vLLM request_finished(): delay_free_blocks=True, kv_transfer_params to the router
                    self.outbox.put(
                        {
                            "type": "prefill_done",
                            "id": r.id,
                            "stats": r.stats,
                            "kv_params": {
                                "remote_block_ids": r.blocks,
                                "remote_engine_id": f"bench-prefill-{self.port}",
                                "remote_host": "127.0.0.1",
                                "remote_port": self.port,
                                "remote_request_id": r.id,
                                "tp_size": 1,
                            },
                        }
                    )

    def _close(self) -> None:
        self.stop.set()
        if self.mode == PUSH:
            self.endpoint.close()
        else:
            self.transport.close()


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
        # push: the prefill's block ids (emulation-only side channel) for the modelled NIC posting time
        # of kvpush's push thread, which is emulated as one serial posting thread and a serial link
        self._src_blocks: dict[str, list[int]] = {}
        self._push_pending: list[tuple[float, Req]] = []  # (core ready_at, request), in ready order
        self._post_free_at = 0.0
        self._link_free_at = 0.0
        # pull state
        self._to_load: list[Req] = []
        self._handshake_state = "none"  # none | running | done
        self._handshake_parked: list[Req] = []
        self._handshake_ready: queue.SimpleQueue[Req] = queue.SimpleQueue()
        self._jobs: dict[str, _NicJob] = {}
        self._bg: queue.SimpleQueue[Req | None] = queue.SimpleQueue()
        self.loop_charged_s = 0.0

    # ---- connector: start ---------------------------------------------------------------------------
    def _start_connector(self) -> None:
        if self.mode == PUSH:
            from kvpush.config import KVPushConfig
            from kvpush.endpoint import DecodeEndpoint, PrefillAddress

            cfg = KVPushConfig(
                engine_id=f"bench-decode-{self.prefill_info['port']}", port=self.prefill_info["port"] + 50
            )
            self.endpoint = DecodeEndpoint(cfg, self.layout)
            self.endpoint.start()
            self.prefill_addr = PrefillAddress(
                self.prefill_info["engine_id"], self.prefill_info["host"], self.prefill_info["port"]
            )
            return
        self.transport = _new_transport(f"bench-pull-decode-{self.prefill_info['port']}")
        self.transport.register(self.layout.regions, "DRAM")
        self.nic = EmulatedNic(self.transport)
        self.nic.start()
        if self.mode == PULL_THREADED:
            threading.Thread(target=self._bg_reader, name="pull-reader", daemon=True).start()

    # ---- connector: scheduler side (update_state_after_alloc) ----------------------------------------
    def _on_alloc(self, r: Req) -> None:
        r.stats["decode_alloc"] = time.monotonic()
        if self.mode == PUSH:
            nb = blocks_for(r.prompt_len, self.layout.block_size)
            self.endpoint.expect(r.id, r.blocks[:nb], r.prompt_len, self.prefill_addr)
        else:
            self._to_load.append(r)

    # ---- connector: worker side, start_load_kv (inside the engine step) ----------------------------
    def _start_load_kv(self) -> None:
        if self.mode == PUSH:
            return
        while not self._handshake_ready.empty():
            self._to_load.append(self._handshake_ready.get())
        to_load, self._to_load = self._to_load, []
        for r in to_load:
            if self._handshake_state != "done":
                # vLLM _read_blocks_for_req: unknown engine -> _background_nixl_handshake, ready later
                self._handshake_parked.append(r)
                if self._handshake_state == "none":
                    self._handshake_state = "running"
                    threading.Thread(target=self._do_handshake, daemon=True).start()
                continue
            if self.mode == PULL_THREADED:
                self._bg.put(r)
            else:
                self._read_blocks(r, charge_loop=True)

    def _do_handshake(self) -> None:
        info = _handshake(f"tcp://127.0.0.1:{self.prefill_info['port']}")
        from kvpush.protocol.layout import packed_planes

        self.remote_layout = packed_planes(self.cm.layout("prefill"), info["base_addr"])
        self.peer = self.transport.add_peer(info["metadata"])
        self._handshake_state = "done"
        for r in self._handshake_parked:
            self._handshake_ready.put(r)
        self._handshake_parked = []

    def _bg_reader(self) -> None:
        while True:
            r = self._bg.get()
            if r is None:
                return
            self._read_blocks(r, charge_loop=False)

    def _read_blocks(self, r: Req, charge_loop: bool) -> None:
        """vLLM _read_blocks: descriptor ids, make_prepped_xfer + transfer (NIC post cost charged)."""
        from kvpush.protocol.plan import build_plan

        t0 = time.monotonic()
        assert r.kv_params is not None
        nb = blocks_for(r.prompt_len, self.layout.block_size)
        plan = build_plan(
            self.remote_layout, self.layout, r.kv_params["remote_block_ids"], r.blocks[:nb], r.prompt_len
        )
        local, remote = plan.nixl_descs()[1], plan.nixl_descs()[0]
        t1 = time.monotonic()
        posted_descs = self.cm.posted_descriptors(
            plan.num_descriptors, r.kv_params["remote_block_ids"], r.blocks[:nb], self.layout
        )
        post = self.cm.post_cost_s(posted_descs)
        _sleep_until(t1 + post)  # the posting thread is busy for what a NIC's postXfer would cost
        t2 = time.monotonic()
        if charge_loop:
            self.loop_charged_s += t2 - t0
        job = _NicJob(
            r.id,
            self.peer,
            local,
            remote,
            f"{r.kv_params['remote_request_id']}:1".encode(),
            plan.nbytes,
            wire_s=self.cm.reference_transfer_s(r.prompt_len),
        )
        r.stats.update(
            read_start=t0,
            descs=posted_descs,
            plan_descs=plan.num_descriptors,
            desc_build_s=t1 - t0,
            post_model_s=post,
            wire_model_s=job.wire_s,
            nbytes=plan.nbytes,
        )
        self._jobs[r.id] = job
        self.nic.jobs.put(job)

    # ---- connector: get_finished (each step) ---------------------------------------------------------
    def _get_finished(self) -> list[str]:
        now = time.monotonic()
        out: list[str] = []
        if self.mode == PUSH:
            try:
                while True:
                    rid, blocks = self.acct.get_nowait()
                    self._src_blocks[rid] = blocks
            except queue.Empty:
                pass
            for res in self.endpoint.finished():
                r = self.waiting_kv.get(res.request_id)
                if r is None:
                    continue
                if not res.ok:
                    r.stats["error"] = res.reason
                    out.append(r.id)
                    continue
                r.stats["kv_ready_core"] = res.ready_at
                r.stats["nbytes"] = res.nbytes
                self._push_pending.append((res.ready_at, r))
            self._push_pending.sort(key=lambda x: x[0])
            # The core's push thread really posted and copied (loopback). On a NIC it would have been
            # busy posting for the modelled time, one request after the other, and the link would
            # have carried the real bytes: replay both as two serial stages after the real completion.
            while self._push_pending:
                ready_at, r = self._push_pending[0]
                if "model_ready_at" not in r.stats:
                    src = self._src_blocks.get(r.id)
                    if src is None:
                        break  # the prefill's block ids have not arrived yet (keeps FIFO order)
                    nb = blocks_for(r.prompt_len, self.layout.block_size)
                    descs = self.cm.sorted_descriptors(src, r.blocks[:nb], r.prompt_len, self.layout)
                    post, wire = self.cm.post_cost_s(descs), self.cm.reference_transfer_s(r.prompt_len)
                    self._post_free_at = max(ready_at, self._post_free_at) + post
                    self._link_free_at = max(self._post_free_at, self._link_free_at) + wire
                    r.stats.update(
                        descs=descs, post_model_s=post, wire_model_s=wire, model_ready_at=self._link_free_at
                    )
                if now < r.stats["model_ready_at"]:
                    break
                self._push_pending.pop(0)
                del self._src_blocks[r.id]
                out.append(r.id)
            return out
        for rid, job in list(self._jobs.items()):
            if job.done and (job.error or now >= job.done_at):
                del self._jobs[rid]
                r = self.waiting_kv[rid]
                if job.error:
                    r.stats["error"] = job.error
                r.stats.update(
                    post_call_s=job.post_call_s,
                    nic_posted=job.posted_at,
                    kv_ready_core=job.copy_done_at,
                    model_ready_at=job.done_at,
                )
                out.append(rid)
        return out

    # ---- main loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        self._start_connector()
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
                        self.outbox.put({"type": "decode_stats", "loop_charged_s": self.loop_charged_s})
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
            self._start_load_kv()
            ctx = sum(r.prompt_len + len(r.tokens) for r in self.running)
            _sleep_until(time.monotonic() + cm.decode_step_s(len(self.running), ctx))
            now = time.monotonic()
            finished_recving = self._get_finished()
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
        if self.mode == PUSH:
            self.endpoint.close()
        else:
            self._bg.put(None)
            self.transport.close()
