"""The I/O edge: background threads that own a NIXL agent and a ZeroMQ side channel.

Engine-facing calls put a command on a queue and ring a doorbell (a pipe), then return. The worker
thread owns everything else: it decodes side-channel messages, feeds the sans-IO state machines, posts
WRITEs and drives them to completion itself (so decode-ready never waits for the engine's next step),
drains NIXL notifications, and ticks the clock. While work is in flight it sleeps `busy_poll_s` between
rounds; when idle it blocks on the doorbell and the socket for up to `idle_poll_s`, so an idle endpoint
costs almost no CPU.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from .config import KVPushConfig
from .layout import KVLayout, LayoutError, Plane, Region, check_compatible
from .wire import Codec, Hello, LayoutWire, Message, WireError

log = logging.getLogger("kvpush")


def layout_to_wire(layout: KVLayout) -> LayoutWire:
    return LayoutWire(
        num_layers=layout.num_layers, block_size=layout.block_size, num_blocks=layout.num_blocks,
        total_kv_heads=layout.total_kv_heads, head_dim=layout.head_dim, dtype_size=layout.dtype_size,
        tp_rank=layout.tp_rank, tp_size=layout.tp_size, kv_per_layer=layout.kv_per_layer,
        token_order=layout.token_order, block_stride=layout.block_stride,
        regions=[(r.addr, r.nbytes, r.device_id) for r in layout.regions],
        planes=[(p.layer, p.kv, p.region, p.offset) for p in layout.planes], model_tag=layout.model_tag)


def layout_from_wire(w: LayoutWire) -> KVLayout:
    """Rebuild a peer's layout; a malformed one raises LayoutError naming the problem."""
    if w.token_order not in ("NHD", "HND"):
        raise LayoutError(f"peer layout has token_order {w.token_order!r}")
    return KVLayout(w.num_layers, w.block_size, w.num_blocks, w.total_kv_heads, w.head_dim, w.dtype_size,
                    w.tp_rank, w.tp_size, w.kv_per_layer, w.token_order,  # type: ignore[arg-type]
                    w.block_stride, tuple(Region(*r) for r in w.regions),
                    tuple(Plane(*p) for p in w.planes), w.model_tag)


def make_hello(config: KVPushConfig, role: str, agent_name: str, metadata: bytes, mem_type: str,
               layout: KVLayout) -> Hello:
    return Hello(engine_id=config.engine_id, role=role, agent_name=agent_name, agent_metadata=metadata,
                 mem_type=mem_type, compat=layout.compat_hash(), layout=layout_to_wire(layout))


def check_peer_hello(mine: KVLayout, hello: Hello, prefill_side: bool) -> KVLayout:
    """The peer's layout, or LayoutError if KV cannot move between the two."""
    peer = layout_from_wire(hello.layout)
    if hello.compat != peer.compat_hash():
        raise LayoutError(f"peer {hello.engine_id!r} sent compat hash {hello.compat} that does not match "
                          "its own layout")
    src, dst = (mine, peer) if prefill_side else (peer, mine)
    check_compatible(src, dst)
    return peer


class Doorbell:
    """Wakes a worker blocked in zmq.Poller from any thread (a pipe is safe to write from anywhere)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def ring(self) -> None:
        try:
            os.write(self.write_fd, b"x")
        except BlockingIOError:
            pass  # already ringing

    def clear(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


@dataclass
class Counters:
    """Plain counters the endpoint exposes through stats() (Prometheus gets the same numbers)."""

    bytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    writes: int = 0
    ok: int = 0
    failed: int = 0
    wire_errors: int = 0
    discarded: int = 0


class Worker:
    """A thread that runs `step()` until stopped; subclasses own the transport and the state machine."""

    name = "kvpush-worker"

    def __init__(self, config: KVPushConfig) -> None:
        self.config = config
        self.codec = Codec(config.max_message_bytes, config.hmac_key)
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.doorbell = Doorbell()
        self.zmq: zmq.Context[Any] = zmq.Context.instance()
        self.poller = zmq.Poller()
        self.poller.register(self.doorbell.read_fd, zmq.POLLIN)
        self.counters = Counters()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.fatal: BaseException | None = None
        self._closed = False

    # lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self) -> None:
        """Stop the thread (it tears its transport down) and close the doorbell; idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self.doorbell.ring()
            self._thread.join(timeout=10)
        if not self._closed:
            self._closed = True
            self.doorbell.close()

    def submit(self, fn: Callable[[], None]) -> None:
        if self.fatal is not None:
            raise RuntimeError(f"kvpush worker is dead: {self.fatal}") from self.fatal
        self.commands.put(fn)
        self.doorbell.ring()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run fn on the worker thread and wait for its result (start-up and tests only)."""
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def run() -> None:
            try:
                box.put((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller as is
                box.put((False, exc))

        self.submit(run)
        try:
            ok, value = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"kvpush worker did not answer within {timeout}s") from None
        if not ok:
            raise value
        return value

    # subclass hooks -----------------------------------------------------------------------------
    def setup(self) -> None: ...
    def teardown(self) -> None: ...
    def step(self, now: float) -> bool:
        """One round of I/O; True if anything happened (keeps the loop in busy mode)."""
        raise NotImplementedError

    def busy(self) -> bool:
        """True while transfers are in flight or expected: poll fast."""
        raise NotImplementedError

    def tracked(self) -> int:
        """Requests the worker's state machine still tracks (leases and timeouts need ticks)."""
        return 0

    def idle_wait_ms(self) -> int:
        """How long to block when not busy: a tick every idle_poll_s while anything is tracked (leases,
        timeouts), five times longer when nothing is (only the doorbell or a message can matter)."""
        return max(1, int(self.config.idle_poll_s * (1000 if self.tracked() else 5000)))

    # loop ---------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.setup()
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        fast, slowest = self.config.busy_poll_s, self.config.max_busy_poll_s
        nap = fast
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        cmd = self.commands.get_nowait()
                    except queue.Empty:
                        break
                    cmd()
                    nap = fast
                if self.step(time.monotonic()):
                    nap = fast
                    continue
                if self.busy():
                    # back off towards `slowest` while nothing happens; from 1 ms on, nap in the poller
                    # so that a doorbell (new work) or a side-channel message cuts the nap short
                    if nap >= 1e-3:
                        self.poller.poll(int(nap * 1000))
                        self.doorbell.clear()
                    else:
                        time.sleep(nap)
                    nap = min(nap * 2, slowest)
                else:
                    self.poller.poll(self.idle_wait_ms())
                    self.doorbell.clear()
                    nap = fast
        except BaseException as exc:  # noqa: BLE001 - the endpoint reports it on the next call
            self.fatal = exc
            log.exception("kvpush worker %s died", self.name)
        finally:
            self.teardown()

    def decode_or_count(self, data: bytes, origin: str) -> Message | None:
        """Decode one message; a bad one is counted and logged, never raised into the loop."""
        try:
            return self.codec.decode(data)
        except WireError as exc:
            self.counters.wire_errors += 1
            log.warning("kvpush: dropped a message from %s: %s", origin, exc)
            return None
