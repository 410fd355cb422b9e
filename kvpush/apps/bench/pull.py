"""The bench's pull connectors: vLLM's NixlConnector, emulated (pull_scheduler.py / pull_worker.py /
base_worker.py).

The router forwards the prefill's block ids; decode's start_load_kv (inside the engine step) handshakes
in the background on first contact, builds descriptors and posts the READ; get_finished polls it each
step; prefill frees its blocks when decode's notification arrives. `pull-threaded` moves descriptor
building and posting to a background thread.

Loopback is not a NIC: UCX over cma copies inside the posting call. So the posting thread is charged the
cost model's NIC posting time, and the real NIXL READ (which carries the loopback copy) runs on an
emulated-NIC thread (`EmulatedNic`); copy time is measured there, never charged to an engine loop."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvpush.apps.bench.steps import DecodeSide, PrefillSide, Req, sleep_until
from kvpush.protocol.layout import blocks_for


def _new_transport(name: str) -> Any:
    """A NIXL transport that can also READ: the pull emulation needs it, the push core never does."""
    from kvpush.transport.base import Descs
    from kvpush.transport.nixl import NixlTransport, prepare_environment

    class _ReadingNixlTransport(NixlTransport):
        def post_read(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> Any:
            return self._post("READ", peer, local, remote, notif, mem_type)

    prepare_environment("lo")
    return _ReadingNixlTransport(name)


# ---- emulated NIC: runs the real NIXL transfers off the engine loops ----------------------------------
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


# ---- side channel for the pull handshake (vLLM: _nixl_handshake_listener / _nixl_handshake over ZMQ)
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


class PullPrefill:
    def __init__(self, eng: PrefillSide) -> None:
        self.eng = eng
        self._notifs: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()

    def start(self) -> dict[str, Any]:
        eng = self.eng
        self.transport = _new_transport(f"bench-pull-prefill-{eng.port}")
        self.transport.register(eng.layout.regions, "DRAM")
        payload = {
            "metadata": self.transport.metadata(),
            "base_addr": eng.layout.regions[0].addr,
            "engine_id": f"bench-prefill-{eng.port}",
        }
        _serve_handshake(f"tcp://127.0.0.1:{eng.port}", payload, eng.stop)
        threading.Thread(target=self._nixl_progress, name="nixl-progress", daemon=True).start()
        return {"engine_id": payload["engine_id"], "host": "127.0.0.1", "port": eng.port}

    def _nixl_progress(self) -> None:
        """vLLM creates its NIXL agent with NIXL's progress thread on (nixl_agent_config defaults,
        vllm base_worker.py), and an RDMA READ needs nothing from its target. On loopback UCX a READ
        only completes while the target process progresses its worker, so the prefill side gets a
        progress thread, polled like kvpush's own workers (50 us while a READ is expected, 20 ms
        otherwise). Notifications it collects are handed to the engine loop, which reads them once
        per step as vLLM's _get_new_notifs does."""
        while not self.eng.stop.is_set():
            for item in self.transport.drain_notifs():
                self._notifs.put(item)
            time.sleep(50e-6 if self.eng.held else 0.02)

    def poll_freed(self) -> None:
        while not self._notifs.empty():
            _peer, msg = self._notifs.get()
            req_id = msg.decode().rsplit(":", 1)[0]
            req = self.eng.held.pop(req_id, None)
            if req is not None:
                self.eng.pool.free(req.blocks)

    def on_prefill_done(self, r: Req) -> None:
        # vLLM request_finished(): delay_free_blocks=True, kv_transfer_params to the router
        port = self.eng.port
        kv_params = {
            "remote_block_ids": r.blocks,
            "remote_engine_id": f"bench-prefill-{port}",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_request_id": r.id,
            "tp_size": 1,
        }
        self.eng.outbox.put({"type": "prefill_done", "id": r.id, "stats": r.stats, "kv_params": kv_params})

    def close(self) -> None:
        self.transport.close()


class PullDecode:
    """`threaded`: descriptors are built and READs posted on a reader thread, not the engine loop."""

    def __init__(self, eng: DecodeSide, threaded: bool) -> None:
        self.eng, self.threaded = eng, threaded
        self.loop_charged_s = 0.0
        self._to_load: list[Req] = []
        self._handshake_state = "none"  # none | running | done
        self._handshake_parked: list[Req] = []
        self._handshake_ready: queue.SimpleQueue[Req] = queue.SimpleQueue()
        self._jobs: dict[str, _NicJob] = {}
        self._bg: queue.SimpleQueue[Req | None] = queue.SimpleQueue()

    def start(self) -> None:
        self.transport = _new_transport(f"bench-pull-decode-{self.eng.prefill_info['port']}")
        self.transport.register(self.eng.layout.regions, "DRAM")
        self.nic = EmulatedNic(self.transport)
        self.nic.start()
        if self.threaded:
            threading.Thread(target=self._bg_reader, name="pull-reader", daemon=True).start()

    def on_alloc(self, r: Req) -> None:
        self._to_load.append(r)

    def start_load_kv(self) -> None:
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
            if self.threaded:
                self._bg.put(r)
            else:
                self._read_blocks(r, charge_loop=True)

    def _do_handshake(self) -> None:
        from kvpush.protocol.layout import packed_planes

        info = _handshake(f"tcp://127.0.0.1:{self.eng.prefill_info['port']}")
        self.remote_layout = packed_planes(self.eng.cm.layout("prefill"), info["base_addr"])
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

        cm, layout = self.eng.cm, self.eng.layout
        t0 = time.monotonic()
        assert r.kv_params is not None
        nb = blocks_for(r.prompt_len, layout.block_size)
        src_blocks = r.kv_params["remote_block_ids"]
        plan = build_plan(self.remote_layout, layout, src_blocks, r.blocks[:nb], r.prompt_len)
        local, remote = plan.nixl_descs()[1], plan.nixl_descs()[0]
        t1 = time.monotonic()
        posted_descs = cm.posted_descriptors(plan.num_descriptors, src_blocks, r.blocks[:nb], layout)
        post = cm.post_cost_s(posted_descs)
        sleep_until(t1 + post)  # the posting thread is busy for what a NIC's postXfer would cost
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
            wire_s=cm.reference_transfer_s(r.prompt_len),
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

    def get_finished(self) -> list[str]:
        now = time.monotonic()
        out: list[str] = []
        for rid, job in list(self._jobs.items()):
            if job.done and (job.error or now >= job.done_at):
                del self._jobs[rid]
                r = self.eng.waiting_kv[rid]
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

    def close(self) -> None:
        self._bg.put(None)
        self.transport.close()
