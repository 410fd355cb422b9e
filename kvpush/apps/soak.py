"""`kvpush soak`: a chaos soak of the push path over real NIXL, with figures that can fail.

Three real processes on 127.0.0.1 besides this driver: a prefill and a decode engine (each one endpoint
over NIXL/UCX with a HostKVCache, both keyed with the same HMAC secret) and an attacker that holds no key.
The driver owns every block pool and hands block tables (fragmented, from `BlockAllocator`) to the
engines; it gets each block back only when the owning endpoint reports the request finished, or when
the process that held it is killed (its memory died with it). Faults come at random points from a seeded
RNG: SIGKILL and restart (the prefill on the same port), SIGSTOP/SIGCONT (sometimes past the peer
timeout), dropped / duplicated / reordered notifications and slow WRITEs (`FaultInjectingTransport`
around NixlTransport inside the engines), aborts on both sides, resends with a new attempt, and
forged, replayed and hijacking frames from the attacker (raw ZeroMQ DEALER; replays come from
`FrameTapControl`, which copies what the decode sends, as an eavesdropper would).

What is checked, and why each check can fail: the decode compares every byte of every request it
declares ready with the pattern the prefill wrote (corrupt_bytes); it scrubs blocks to zero when it
hands them back and counts non-zero bytes when it gets them again and at the end (stale_writes: a WRITE
that landed after the blocks were freed); the pools must be whole at the end (leaked_blocks_*); an
attacker frame that got a Hello answer, or an honest request that ended for the attacker's reason,
counts as unauthorized_accepted. `--self-check` breaks the harness on purpose so each counter is seen
to rise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from kvpush.apps.demo.cli import _free_port_range
from kvpush.apps.demo.pattern import count_dirty_bytes, count_wrong_bytes, fill, scrub
from kvpush.apps.demo.procs import BlockAllocator, Geometry
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.endpoint.control import ControlChannel, ControlListener, ControlPlane, ZmqControl
from kvpush.protocol.layout import Region
from kvpush.transport.base import Descs, Indices, PreparedList, Rows, Transport, XferHandle, XferState

PREFILL_ID, DECODE_ID = "soak-prefill", "soak-decode"
MARK = "soak-attacker"  # the attacker's abort reason: an honest request ending with it was hijacked
KEY = b"kvpush-soak-shared-secret-32byte"
DRIVER_FAULTS = (
    "kill_prefill",
    "kill_decode",
    "stop_prefill",
    "stop_decode",
    "abort_decode",
    "abort_prefill",
    "resend",
    "forged",
    "replayed",
    "hijack",
)
TRANSPORT_FAULTS = ("notif_drop", "notif_dup", "notif_reorder", "slow_write_complete", "slow_write_post")
FAULT_KINDS = DRIVER_FAULTS + TRANSPORT_FAULTS
SELF_CHECKS = ("corrupt", "stale", "leak", "unauthorized")


def soak_geometry(block_size: int, num_blocks: int) -> Geometry:
    """Small caches (2 KiB per token) so a 2-core box moves many requests; the pattern checks every byte."""
    return Geometry(
        layers=4,
        total_kv_heads=2,
        head_dim=64,
        dtype_size=2,
        block_size=block_size,
        num_blocks=num_blocks,
        tp_size=1,
    )


def soak_config(engine_id: str, port: int) -> KVPushConfig:
    """Short leases and timeouts so a request that a fault stranded comes back within seconds."""
    return KVPushConfig(
        engine_id=engine_id,
        port=port,
        hmac_key=KEY,
        lease_s=2.0,
        ready_timeout_s=3.0,
        write_timeout_s=0.8,
        write_linger_s=0.3,
        ping_interval_s=0.25,
        peer_timeout_s=1.5,
        handshake_timeout_s=3.0,
        tombstone_s=30.0,
    )


# ---- fault injectors (inside the engine processes) ------------------------------------------------
@dataclass
class _SlowHandle:
    """A WRITE the fault injector holds back (not posted until post_at) or reports late (done_at)."""

    inner: XferHandle | None
    post: Callable[[], XferHandle] | None
    post_at: float = 0.0
    done_at: float = 0.0


class FaultInjectingTransport:
    """Fault injector: a Transport around a real one (NixlTransport) that drops, duplicates and reorders
    received notifications, and holds WRITEs back before posting them or reports their completion late.

    The endpoint cannot tell these faults from a lossy or slow network, which is the point: the protocol
    must survive them without leaking a block or letting a byte land after a free. Counts per kind are
    read by the process's main thread (`take_counts`)."""

    def __init__(self, inner: Transport, rates: dict[str, float], seed: int, max_delay_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        self.rates = rates
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.held: list[tuple[float, tuple[str, bytes]]] = []
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            out, self._counts = dict(self._counts), Counter()
        return out

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def _slow(self, post: Callable[[], XferHandle]) -> XferHandle:
        r, now = self.rng.random(), time.monotonic()
        hold = self.rates.get("slow_write_post", 0.0)
        late = self.rates.get("slow_write_complete", 0.0)
        if r < hold:
            self._count("slow_write_post")
            return _SlowHandle(None, post, post_at=now + self.rng.uniform(0.05, self.max_delay_s))
        if r < hold + late:
            self._count("slow_write_complete")
            return _SlowHandle(post(), None, done_at=now + self.rng.uniform(0.05, self.max_delay_s))
        return post()

    # -- the Transport contract ---------------------------------------------------------------------
    def register(self, regions: Sequence[Region], mem_type: str) -> None:
        self.inner.register(regions, mem_type)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def connect(self, peer: str) -> None:
        self.inner.connect(peer)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def post_write(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> XferHandle:
        return self._slow(lambda: self.inner.post_write(peer, local, remote, notif, mem_type))

    def prepare(self, peer: str | None, rows: Rows, mem_type: str) -> PreparedList:
        return self.inner.prepare(peer, rows, mem_type)

    def make_write(
        self, local: PreparedList, local_idx: Indices, remote: PreparedList, remote_idx: Indices, notif: bytes
    ) -> XferHandle:
        return self.inner.make_write(local, local_idx, remote, remote_idx, notif)

    def repost(self, handle: XferHandle, notif: bytes | None = None) -> None:
        self.inner.repost(handle, notif)

    def post_prepared(
        self, local: PreparedList, local_idx: Indices, remote: PreparedList, remote_idx: Indices, notif: bytes
    ) -> XferHandle:
        return self._slow(lambda: self.inner.post_prepared(local, local_idx, remote, remote_idx, notif))

    def made_at(self) -> float | None:
        return self.inner.made_at()

    def release_prepared(self, plist: PreparedList) -> None:
        self.inner.release_prepared(plist)

    def poll(self, handle: XferHandle) -> XferState:
        if not isinstance(handle, _SlowHandle):
            return self.inner.poll(handle)
        now = time.monotonic()
        if handle.inner is None:
            if now < handle.post_at or handle.post is None:
                return "PROC"
            handle.inner, handle.post = handle.post(), None
        state = self.inner.poll(handle.inner)
        return "PROC" if state == "DONE" and now < handle.done_at else state

    def release(self, handle: XferHandle) -> None:
        if not isinstance(handle, _SlowHandle):
            self.inner.release(handle)
        elif handle.inner is not None:
            self.inner.release(handle.inner)
        else:
            handle.post = None  # abandoned before it was posted: it never will be

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.inner.send_notif(peer, msg)

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        now = time.monotonic()
        out: list[tuple[str, bytes]] = []
        drop = self.rates.get("notif_drop", 0.0)
        dup = drop + self.rates.get("notif_dup", 0.0)
        reorder = dup + self.rates.get("notif_reorder", 0.0)
        for item in self.inner.drain_notifs():
            r = self.rng.random() if item[1] else 1.0  # empty liveness probes pass untouched
            if r < drop:
                self._count("notif_drop")
            elif r < dup:
                self._count("notif_dup")
                out += [item, item]
            elif r < reorder:
                self._count("notif_reorder")
                self.held.append((now + self.rng.uniform(0.002, 0.05), item))
            else:
                out.append(item)
        due = [h for h in self.held if h[0] <= now]
        if due:
            self.held = [h for h in self.held if h[0] > now]
            out += [item for _t, item in due]  # after the newer ones: reordered
        return out

    def close(self) -> None:
        self.inner.close()


class _TapChannel:
    def __init__(self, inner: ControlChannel, tap: FrameTapControl) -> None:
        self.inner, self.tap, self.pollable = inner, tap, inner.pollable

    def send(self, data: bytes) -> None:
        self.tap.keep(data)
        self.inner.send(data)

    def recv(self) -> bytes | None:
        return self.inner.recv()

    def peer_closed(self) -> bool:
        return self.inner.peer_closed()

    def close(self) -> None:
        self.inner.close()


class FrameTapControl:
    """Fault injector (an eavesdropper's capture): the ZeroMQ control plane, keeping copies of the last
    frames this decode sent (Hellos, sealed registrations, aborts, pings) for the attacker to replay."""

    def __init__(self, inner: ControlPlane, keep: int = 48) -> None:
        self.inner = inner
        self.frames: deque[bytes] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def keep(self, data: bytes) -> None:
        with self._lock:
            self.frames.append(bytes(data))

    def captured(self) -> list[bytes]:
        with self._lock:
            return list(self.frames)

    def listen(self, host: str, port: int, max_message_bytes: int) -> ControlListener:
        return self.inner.listen(host, port, max_message_bytes)

    def connect(self, host: str, port: int, max_message_bytes: int) -> ControlChannel:
        return _TapChannel(self.inner.connect(host, port, max_message_bytes), self)


# ---- the engine processes ---------------------------------------------------------------------------
def _nixl_with_faults(
    config: KVPushConfig, role: str, rates: dict[str, float], seed: int, out: list[FaultInjectingTransport]
) -> Callable[[], Transport]:
    def make() -> Transport:
        from kvpush.endpoint.base import new_nixl_transport

        t = FaultInjectingTransport(
            new_nixl_transport(config, role, 0), rates, seed, 1.5 * config.write_timeout_s
        )
        out.append(t)
        return t

    return make


def _send_faults(conn: Connection, injectors: list[FaultInjectingTransport]) -> None:
    for t in injectors:
        counts = t.take_counts()
        if counts:
            conn.send(("faults", counts))


def prefill_main(conn: Connection, geo: Geometry, port: int, rates: dict[str, float], seed: int) -> None:
    """The prefill engine: fills a request's source blocks with its pattern, hands them over, and gives
    the driver each block table back once the endpoint reports the request finished."""
    from kvpush.backends.host import HostKVCache

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    cache = HostKVCache(geo.layout(0))
    cfg = soak_config(PREFILL_ID, port)
    injectors: list[FaultInjectingTransport] = []
    ep = PrefillEndpoint(
        cfg, cache.layout, transport=_nixl_with_faults(cfg, "prefill", rates, seed, injectors)
    )
    ep.start()
    conn.send(("up", ep.address))
    try:
        while True:
            if conn.poll(0.002):
                cmd = conn.recv()
                if cmd[0] == "prefill":
                    _, rid, blocks, n, tag = cmd
                    fill(cache.buffer, cache.layout, blocks, n, tag)
                    ep.prefill_done(rid, blocks, n)
                elif cmd[0] == "abort":
                    ep.abort(cmd[1], "soak: aborted by the prefill engine")
                elif cmd[0] == "stats":
                    conn.send(("stats", ep.stats(), ep.pending()))
                elif cmd[0] == "stop":
                    break
            for res in ep.finished():
                conn.send(("released", res.request_id, res.ok, res.reason, list(res.block_ids)))
            _send_faults(conn, injectors)
    except (EOFError, OSError):
        pass  # the driver is gone: so are we
    finally:
        ep.close()
        with contextlib.suppress(OSError):
            conn.send(("bye",))


def decode_main(
    conn: Connection, geo: Geometry, prefill: tuple[str, int], rates: dict[str, float], seed: int, check: str
) -> None:
    """The decode engine: registers the blocks the driver gives it, verifies every byte of every request
    it declares ready, scrubs blocks before handing them back and checks them when they come again."""
    from kvpush.backends.host import HostKVCache

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    cache = HostKVCache(geo.layout(0))
    buf, layout = cache.buffer, cache.layout
    cfg = soak_config(DECODE_ID, 0)
    injectors: list[FaultInjectingTransport] = []
    tap = FrameTapControl(ZmqControl())
    ep = DecodeEndpoint(
        cfg, layout, transport=_nixl_with_faults(cfg, "decode", rates, seed, injectors), control=tap
    )
    ep.start()
    addr = PrefillAddress(PREFILL_ID, prefill[0], prefill[1], 1)
    with contextlib.suppress(Exception):  # a frozen or restarting prefill: expect() connects lazily
        ep.connect(addr, timeout=2.0)
    live: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}  # (request, blocks) -> (tokens, tag)
    conn.send(("up", None))
    try:
        while True:
            if conn.poll(0.002):
                cmd = conn.recv()
                if cmd[0] == "expect":
                    _, rid, blocks, n, tag = cmd
                    dirty = count_dirty_bytes(buf, layout, blocks)
                    if dirty:
                        which = [b for b in blocks if count_dirty_bytes(buf, layout, [b])]
                        conn.send(("stale", rid, dirty, f"at reallocation, blocks {which[:8]}"))
                        scrub(buf, layout, blocks)
                    live[(rid, tuple(blocks))] = (n, tag)
                    ep.expect(rid, blocks, n, addr)
                elif cmd[0] == "abort":
                    ep.abort(cmd[1], "soak: aborted by the decode engine")
                elif cmd[0] == "capture":
                    conn.send(("captured", tap.captured()))
                elif cmd[0] == "audit":
                    marked = [b for b in cmd[1] if count_dirty_bytes(buf, layout, [b])]
                    conn.send(("audit", count_dirty_bytes(buf, layout, cmd[1]), marked[:20]))
                elif cmd[0] == "stats":
                    conn.send(("stats", ep.stats(), ep.pending()))
                elif cmd[0] == "stop":
                    break
            for res in ep.finished():
                n, tag = live.pop((res.request_id, res.block_ids), (0, 0))
                blocks = list(res.block_ids)
                wrong = 0
                if res.ok and n:
                    if check == "corrupt":  # self-check: a wrong token where a right one was
                        fill(buf, layout, blocks[:1], 1, tag + 1)
                    wrong = count_wrong_bytes(buf, layout, blocks, n, tag)
                scrub(buf, layout, blocks)
                if check == "stale":  # self-check: a byte lands after the free
                    fill(buf, layout, blocks[:1], 1, 7)
                conn.send(("result", res.request_id, res.ok, res.reason, blocks, wrong, n > 0))
            _send_faults(conn, injectors)
    except (EOFError, OSError):
        pass
    finally:
        ep.close()
        with contextlib.suppress(OSError):
            conn.send(("bye",))


# ---- the attacker ------------------------------------------------------------------------------------
def attacker_main(conn: Connection, port: int, self_check_key: bytes | None) -> None:
    """A local process without the key: forged frames, replays of captured ones, Hellos reusing the
    victim decode's engine id, each on a fresh DEALER connection to the prefill's side channel. It
    reports whether any got a Hello back (a handshake the prefill accepted)."""
    import msgspec
    import zmq

    from kvpush.protocol.handshake import Session, hello_frame
    from kvpush.protocol.wire import HELLO_MAC, PLAIN, Abort, Codec, Hello, Registration, split_frame

    codec = Codec()
    self = argparse.Namespace(nonce=b"")  # the self-check Hello's nonce, for its session
    ctx = zmq.Context()
    wrong_key = os.urandom(32)
    rng = random.Random(port)

    def forged_session() -> Session:
        return Session(codec, wrong_key, os.urandom(16), os.urandom(16), "decode")

    def hello_of(frames: list[bytes]) -> Hello | None:
        for f in frames:
            with contextlib.suppress(Exception):
                _flag, body, _s, _t = split_frame(f, codec.max_bytes)
                msg = codec.decode(body)
                if isinstance(msg, Hello):
                    return msg
        return None

    def build(kind: str, rid: str, blocks: list[int], captured: list[bytes]) -> list[bytes]:
        reg = Registration(
            request_id=rid,
            attempt=1_000_000 + rng.randrange(1000),
            decode_engine_id=DECODE_ID,
            decode_rank=0,
            decode_tp=1,
            block_ids=blocks or [0],
            num_tokens=1,
            expires_at=1e12,
        )
        abort = Abort(request_id=rid, attempt=0, decode_engine_id=DECODE_ID, decode_rank=0, reason=MARK)
        if kind == "forged":
            s = forged_session()
            return [
                bytes([PLAIN]) + codec.encode(reg),
                s.seal(reg),
                bytes([PLAIN]) + codec.encode(abort),
                s.seal(abort),
            ]
        if kind == "replayed":
            return list(captured)
        if kind == "self_check":  # a key holder's own Hello: accepted, as SECURITY.md says it is
            victim = hello_of(captured)
            if victim is None or self_check_key is None:
                return []
            mine = msgspec.structs.replace(victim, engine_id="soak-key-holder", nonce=os.urandom(16))
            self.nonce = mine.nonce
            return [hello_frame(codec, mine, self_check_key)]
        victim = hello_of(captured)  # hijack: a Hello naming the victim decode's engine id
        if victim is None:
            return []
        forged = msgspec.structs.replace(victim, nonce=os.urandom(16), agent_name="soak-evil-agent")
        out = [hello_frame(codec, forged, wrong_key), hello_frame(codec, forged, None)]
        return out + [f for f in captured if f[:1] == bytes([HELLO_MAC])][-1:]  # and the victim's own Hello

    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, kind, rid, blocks, captured = cmd
            frames = build(kind, rid, blocks, captured)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            accepted = 0
            for f in frames:
                sock.send(f)
            deadline = time.monotonic() + 0.4
            while time.monotonic() < deadline:
                if not sock.poll(50):
                    continue
                reply = sock.recv()
                answer = hello_of([reply])
                if answer is None:
                    continue
                accepted += 1  # answered; without the key the session is useless, and binds nothing
                for f in captured:  # try the victim's captured sealed frames on it anyway
                    sock.send(f)
                if kind == "self_check" and self_check_key is not None:
                    # a key holder with an identity of its own aborts another decode's request
                    s = Session(codec, self_check_key, self.nonce, answer.nonce, "decode")
                    evil = Abort(
                        request_id=rid,
                        attempt=0,
                        decode_engine_id="soak-key-holder",
                        decode_rank=0,
                        reason=MARK,
                    )
                    sock.send(s.seal(evil))
            sock.close()
            conn.send(("attacked", kind, len(frames), accepted))
    except (EOFError, OSError):
        pass
    finally:
        ctx.term()


# ---- the driver --------------------------------------------------------------------------------------
@dataclass
class _Req:
    rid: str
    n: int
    tag: int
    p_gen: int = -1  # prefill incarnation holding its source blocks (-1: none, settled)
    d_held: dict[tuple[int, ...], int] = field(default_factory=dict)  # decode blocks -> incarnation
    last_blocks: tuple[int, ...] = ()
    outcome: str = ""  # "", "completed", "failed"
    reason: str = ""
    p_reason: str = ""
    attacked: bool = False
    settled: bool = False
    hijacked: bool = False


@dataclass
class _Proc:
    proc: Any
    conn: Connection
    gen: int
    up: bool = False
    address: tuple[str, int] | None = None
    stopped_until: float = 0.0
    bye: bool = False


class Soak:
    """The parent: owns the pools, starts requests, injects the driver-level faults, collects results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.ctx = mp.get_context("spawn")
        self.check: str = args.self_check
        rates = {
            "notif_drop": 0.02,
            "notif_dup": 0.03,
            "notif_reorder": 0.04,
            "slow_write_complete": 0.03,
            "slow_write_post": 0.03,
        }
        self.rates = rates if args.faults == "all" else {}
        self.p_geo = soak_geometry(16, args.prefill_blocks)
        self.d_geo = soak_geometry(32, args.decode_blocks)
        self.p_alloc = BlockAllocator(self.p_geo.num_blocks, args.seed, 4)
        self.d_alloc = BlockAllocator(self.d_geo.num_blocks, args.seed + 1, 4)
        self.port = _free_port_range(1)
        self.reqs: dict[str, _Req] = {}
        self.faults: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.stale = 0
        self.corrupt = 0
        self.unauthorized = 0
        self.double_freed = 0
        self.attacks: Counter[str] = Counter()
        self.captured: list[bytes] = []
        self.captures = 0
        self.hello_answers = 0  # Hellos the prefill answered to the attacker (they bind nothing)
        self.examples: dict[str, str] = {}  # failure kind -> one reason in full
        self.d_history: dict[int, str] = {}  # decode block -> who returned it last, how, when
        self.t0 = time.monotonic()
        self.replies: dict[tuple[int, str], tuple[Any, ...]] = {}
        self._blocks_of_prefill: dict[str, list[int]] = {}  # request -> source blocks the prefill holds
        self.gens = Counter[str]()
        self.prefill: _Proc | None = None
        self.decode: _Proc | None = None
        self.attacker: _Proc | None = None
        self.pending_attacks: list[tuple[float, str]] = []
        self.log: list[str] = []

    # -- processes ---------------------------------------------------------------------------------
    def _spawn(self, role: str) -> _Proc:
        parent, child = self.ctx.Pipe()
        gen = self.gens[role]
        self.gens[role] += 1
        seed = self.args.seed * 1000 + 10 * gen + (1 if role == "decode" else 0)
        if role == "prefill":
            target: Any = prefill_main
            args: tuple[Any, ...] = (child, self.p_geo, self.port, self.rates, seed)
        elif role == "decode":
            target = decode_main
            args = (child, self.d_geo, ("127.0.0.1", self.port), self.rates, seed, self.check)
        else:
            target = attacker_main
            args = (child, self.port, KEY if self.check == "unauthorized" else None)
        proc = self.ctx.Process(target=target, args=args, name=f"kvpush-soak-{role}", daemon=True)
        proc.start()
        child.close()
        return _Proc(proc, parent, gen, up=role == "attacker")

    def _wait_up(self, p: _Proc, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not p.up:
            if time.monotonic() > deadline or not p.proc.is_alive():
                raise RuntimeError(f"{p.proc.name} did not come up")
            self.pump(0.02)

    def _kill(self, p: _Proc) -> None:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(p.proc.pid, signal.SIGCONT)
            os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.join(10)
        with contextlib.suppress(OSError):
            p.conn.close()

    def restart(self, role: str) -> None:
        """SIGKILL, then a new process (the prefill on the same port). The killed process's memory, and
        with it every block it held, is gone: those blocks go back to the pool as reclaimed."""
        old = self.prefill if role == "prefill" else self.decode
        assert old is not None
        self._kill(old)
        for r in self.reqs.values():
            if role == "prefill" and r.p_gen == old.gen:
                self.p_alloc.release(self._blocks_of_prefill.pop(r.rid))
                r.p_gen, r.p_reason = -1, "prefill process killed"
                self._settle(r)
            if role == "decode":
                for blocks, gen in list(r.d_held.items()):
                    if gen == old.gen:
                        del r.d_held[blocks]
                        self.d_alloc.release(list(blocks))
                        if blocks == r.last_blocks:
                            r.outcome, r.reason = "failed", "decode process killed"
            self._settle(r)
        new = self._spawn(role)
        if role == "prefill":
            self.prefill = new
        else:
            self.decode = new
        self._wait_up(new)

    # -- messages ----------------------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        procs = [p for p in (self.prefill, self.decode, self.attacker) if p is not None]
        conns = [p.conn for p in procs if not p.conn.closed]
        for ready in wait(conns, timeout):
            p = next(x for x in procs if x.conn is ready)
            conn = p.conn
            try:
                while conn.poll():
                    self._on_message(p, conn.recv())
            except (EOFError, OSError):
                p.bye = True
        now = time.monotonic()
        for q in (self.prefill, self.decode):
            if q is not None and q.stopped_until and now >= q.stopped_until:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(q.proc.pid, signal.SIGCONT)
                q.stopped_until = 0.0
        for at, kind in list(self.pending_attacks):
            if now >= at:
                self.pending_attacks.remove((at, kind))
                self.attack(kind)

    def _on_message(self, p: _Proc, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "up":
            p.up, p.address = True, msg[1]
        elif kind == "faults":
            self.faults.update(msg[1])
        elif kind == "released" and p is self.prefill:
            _, rid, ok, reason, blocks = msg
            r = self.reqs.get(rid)
            held = self._blocks_of_prefill.get(rid)
            if r is None or r.p_gen != p.gen or held != blocks:
                self.double_freed += len(blocks)
                self.log.append(f"prefill returned blocks it did not hold: {rid} {blocks}")
                return
            del self._blocks_of_prefill[rid]
            self.p_alloc.release(blocks)
            r.p_gen, r.p_reason = -1, reason
            self._hijacked(r, reason)
            self._settle(r)
        elif kind == "result" and p is self.decode:
            _, rid, ok, reason, blocks, wrong, known = msg
            r = self.reqs.get(rid)
            key = tuple(blocks)
            if r is None or r.d_held.get(key) != p.gen or not known:
                self.double_freed += len(blocks)
                self.log.append(f"decode returned blocks it did not hold: {rid} {blocks}")
                return
            del r.d_held[key]
            self.d_alloc.release(blocks)
            for b in blocks:
                self.d_history[b] = (
                    f"{rid} {'ok' if ok else reason[:80]} at {time.monotonic() - self.t0:.2f}s"
                )
            self.corrupt += wrong
            self._hijacked(r, reason)
            if key == r.last_blocks:
                r.outcome = "completed" if ok and wrong == 0 else "failed"
                r.reason = "" if ok and wrong == 0 else (reason or f"{wrong} wrong bytes")
            self._settle(r)
        elif kind == "stale":
            self.stale += msg[2]
            self.log.append(f"stale bytes {msg[2]} in blocks of {msg[1]} {msg[3]}")
            for b in [int(x) for x in msg[3].split("[")[-1].rstrip("]").split(",") if x.strip()][:4]:
                self.log.append(f"  block {b} last returned by {self.d_history.get(b, '?')}")
        elif kind == "captured":
            self.captured, self.captures = msg[1], self.captures + 1
        elif kind == "attacked":
            _, what, nframes, accepted = msg
            self.attacks[what] += nframes
            if accepted:  # harmless unless it had an effect (counted where the effect shows)
                self.hello_answers += accepted
                self.log.append(f"attacker's {what} frames got {accepted} Hello answer(s)")
        elif kind in ("stats", "audit"):
            self.replies[(p.gen, kind)] = msg
        elif kind == "bye":
            p.bye = True

    def _hijacked(self, r: _Req, reason: str) -> None:
        """An honest request ended for the attacker's reason: its frames had an effect."""
        if MARK in reason and not r.hijacked:
            r.hijacked = True
            self.unauthorized += 1

    def _settle(self, r: _Req) -> None:
        if r.settled or r.p_gen >= 0 or r.d_held:
            return
        r.settled = True
        if not r.outcome:
            r.outcome = "failed"
        if r.outcome == "failed":
            kind = _reason_kind(r.reason or r.p_reason)
            self.reasons[kind] += 1
            self.examples.setdefault(kind, (r.reason or r.p_reason)[:300])

    # -- requests and faults -----------------------------------------------------------------------
    def live(self) -> list[_Req]:
        return [r for r in self.reqs.values() if r.p_gen >= 0 or r.d_held]

    def start_request(self, i: int) -> bool:
        n = self.rng.randint(16, self.args.max_tokens)
        p_need, d_need = -(-n // self.p_geo.block_size), -(-n // self.d_geo.block_size)
        if len(self.p_alloc.free) < p_need or len(self.d_alloc.free) < d_need:
            return False
        assert self.prefill is not None and self.decode is not None
        r = _Req(f"req-{i}", n, i + 1)
        self.reqs[r.rid] = r
        p_blocks = self.p_alloc.allocate(p_need)
        self._blocks_of_prefill[r.rid] = p_blocks
        r.p_gen = self.prefill.gen
        prefill_cmd = ("prefill", r.rid, p_blocks, n, r.tag)
        if self.rng.random() < 0.5:
            self._expect(r)
            self._send(self.prefill, prefill_cmd)
        else:
            self._send(self.prefill, prefill_cmd)
            self._expect(r)
        return True

    def _expect(self, r: _Req) -> bool:
        assert self.decode is not None
        need = -(-r.n // self.d_geo.block_size)
        if len(self.d_alloc.free) < need:
            return False
        blocks = self.d_alloc.allocate(need)
        r.last_blocks = tuple(blocks)
        r.d_held[r.last_blocks] = self.decode.gen
        r.outcome = ""
        self._send(self.decode, ("expect", r.rid, blocks, r.n, r.tag))
        return True

    def _send(self, p: _Proc, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):
            p.conn.send(msg)

    def inject(self, kind: str) -> None:
        assert self.prefill is not None and self.decode is not None
        live = self.live()
        if kind in ("kill_prefill", "kill_decode"):
            self.restart("prefill" if kind == "kill_prefill" else "decode")
        elif kind in ("stop_prefill", "stop_decode"):
            p = self.prefill if kind == "stop_prefill" else self.decode
            if p.stopped_until:
                return
            cfg = soak_config("x", 0)
            span = self.rng.uniform(0.1, 2.5 * cfg.peer_timeout_s)
            if kind == "stop_decode":
                self.capture()
            os.kill(p.proc.pid, signal.SIGSTOP)
            p.stopped_until = time.monotonic() + span
            if kind == "stop_decode" and span > cfg.peer_timeout_s + 0.5 and self.rng.random() < 0.7:
                # the victim looks gone: try its captured Hello now, when a rebind would be accepted
                self.pending_attacks.append((time.monotonic() + cfg.peer_timeout_s + 0.2, "replayed"))
        elif kind == "abort_decode":
            cands = [r for r in live if r.d_held]
            if not cands:
                return
            self._send(self.decode, ("abort", self.rng.choice(cands).rid))
        elif kind == "abort_prefill":
            cands = [r for r in live if r.p_gen >= 0]
            if not cands:
                return
            self._send(self.prefill, ("abort", self.rng.choice(cands).rid))
        elif kind == "resend":
            cands = [r for r in live if r.last_blocks in r.d_held]
            if not cands or not self._expect(self.rng.choice(cands)):
                return
        else:
            self.attack(kind)
            return
        self.faults[kind] += 1

    def attack(self, kind: str) -> None:
        assert self.decode is not None and self.attacker is not None
        self.capture()
        live = [r for r in self.live() if r.d_held and (kind != "self_check" or r.p_gen >= 0)]
        target = self.rng.choice(live) if live else None
        if target is not None:
            target.attacked = True
        blocks = self.d_alloc.free[: self.rng.randint(1, 4)]
        self._send(self.attacker, ("attack", kind, target.rid if target else "req-0", blocks, self.captured))
        self.faults[kind] += 1

    def capture(self) -> None:
        """The decode's latest sent frames (the last capture is kept while the decode is stopped)."""
        assert self.decode is not None
        if self.decode.stopped_until:
            return
        self._send(self.decode, ("capture",))
        seen, deadline = self.captures, time.monotonic() + 1.0
        while self.captures == seen and time.monotonic() < deadline:
            self.pump(0.02)

    def run(self) -> dict[str, Any]:
        t0 = self.t0 = time.monotonic()
        self.attacker = self._spawn("attacker")
        self.prefill = self._spawn("prefill")
        self._wait_up(self.prefill)
        self.decode = self._spawn("decode")
        self._wait_up(self.decode)
        n = self.args.requests
        schedule = self._schedule(n)
        i = 0
        while i < n:
            self.pump(0.002)
            if len(self.live()) >= self.args.window:
                continue
            if not self.start_request(i):
                continue
            for kind in schedule.get(i, []):
                self.inject(kind)
            i += 1
        self._drain()
        elapsed = time.monotonic() - t0
        return self._report(elapsed)

    def _schedule(self, n: int) -> dict[int, list[str]]:
        """Every kind at least once (spread over the run), then more at random: faults at random points."""
        out: dict[int, list[str]] = {}
        if self.check == "unauthorized":  # self-check: a key holder's abort, a few times
            for k in range(6):
                out.setdefault(int(n * (0.2 + 0.1 * k)), []).append("self_check")
        if self.args.faults != "all":
            return out
        kinds = list(DRIVER_FAULTS)
        self.rng.shuffle(kinds)
        for k, kind in enumerate(kinds):
            at = int(n * (0.05 + 0.85 * (k + self.rng.random()) / len(kinds)))
            out.setdefault(min(at, n - 1), []).append(kind)
        for i in range(n):
            if self.rng.random() < self.args.fault_rate:
                out.setdefault(i, []).append(self.rng.choice(DRIVER_FAULTS))
        return out

    def _drain(self) -> None:
        """Let every lease, fence and stop pass; then every block must be back."""
        cfg = soak_config("x", 0)
        bound = cfg.ready_timeout_s + cfg.write_bound_s + 2 * cfg.peer_timeout_s + 5.0
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and (self.live() or self.pending_attacks):
            self.pump(0.02)
        for p in (self.prefill, self.decode):
            if p is not None and p.stopped_until:
                p.stopped_until = time.monotonic()
        self.pump(0.05)
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and self.live():
            self.pump(0.02)
        for r in self.live():
            self.log.append(f"still held at the end: {r.rid} prefill gen {r.p_gen}, decode {r.d_held}")

    def ask(self, p: _Proc, msg: tuple[Any, ...], timeout: float = 10.0) -> tuple[Any, ...] | None:
        """Send a query to a child and wait for its answer of the same kind (other messages go on)."""
        self.replies.pop((p.gen, msg[0]), None)
        self._send(p, msg)
        deadline = time.monotonic() + timeout
        while (p.gen, msg[0]) not in self.replies and time.monotonic() < deadline:
            self.pump(0.02)
        return self.replies.pop((p.gen, msg[0]), None)

    def _leaked(self, alloc: BlockAllocator, total: int) -> tuple[int, int]:
        free = alloc.free
        dup = len(free) - len(set(free))
        return total - len(set(free)), dup

    def _report(self, elapsed: float) -> dict[str, Any]:
        assert self.prefill is not None and self.decode is not None
        p_reply = self.ask(self.prefill, ("stats",)) or ("stats", {}, -1)
        d_reply = self.ask(self.decode, ("stats",)) or ("stats", {}, -1)
        p_stats, p_pending, d_stats, d_pending = p_reply[1], p_reply[2], d_reply[1], d_reply[2]
        audit = self.ask(self.decode, ("audit", list(self.d_alloc.free)))
        end_dirty = int(audit[1]) if audit else 0
        if end_dirty and audit:
            self.log.append(f"{end_dirty} non-zero bytes in the decode's free blocks at the end")
            for b in audit[2][:8]:
                self.log.append(f"  dirty block {b}, last returned by {self.d_history.get(b, '?')}")
        self.stale += end_dirty
        if self.check == "leak" and self.p_alloc.free:
            self.p_alloc.free.pop()  # self-check: the driver loses one block
        p_leak, p_dup = self._leaked(self.p_alloc, self.p_geo.num_blocks)
        d_leak, d_dup = self._leaked(self.d_alloc, self.d_geo.num_blocks)
        reqs = list(self.reqs.values())
        completed = sum(1 for r in reqs if r.outcome == "completed")
        failed = sum(1 for r in reqs if r.outcome == "failed")
        return {
            "command": "kvpush soak " + " ".join(self.args.argv),
            "seed": self.args.seed,
            "requests": len(reqs),
            "completed": completed,
            "failed_with_reason": {
                "count": failed,
                "by_kind": dict(sorted(self.reasons.items())),
                "examples": self.examples,
            },
            "unsettled": len(self.live()),
            "leaked_blocks_prefill": p_leak,
            "leaked_blocks_decode": d_leak,
            "double_returned_blocks": p_dup + d_dup + self.double_freed,
            "corrupt_bytes": self.corrupt,
            "stale_writes": self.stale,
            "unauthorized_accepted": self.unauthorized,
            "faults_injected": {k: self.faults.get(k, 0) for k in FAULT_KINDS},
            "attacker_frames_sent": dict(self.attacks),
            "attacker_hello_answers": self.hello_answers,
            "restarts": {"prefill": self.gens["prefill"] - 1, "decode": self.gens["decode"] - 1},
            "endpoint_pending_at_end": {"prefill": p_pending, "decode": d_pending},
            "prefill_stats": p_stats,
            "decode_stats": d_stats,
            "elapsed_s": round(elapsed, 1),
            "requests_per_s": round(len(reqs) / max(elapsed, 1e-9), 2),
            "load_average": list(os.getloadavg()),
            "self_check": self.check or None,
            "notes": self.log[:50],
        }

    def close(self) -> None:
        """Every child goes, whatever happened: SIGCONT (a stopped one cannot exit), stop, then SIGKILL."""
        for p in (self.prefill, self.decode, self.attacker):
            if p is None:
                continue
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.proc.pid, signal.SIGCONT)
            self._send(p, ("stop",))
        for p in (self.prefill, self.decode, self.attacker):
            if p is None:
                continue
            p.proc.join(10)
            if p.proc.is_alive():
                self._kill(p)


def _reason_kind(reason: str) -> str:
    """A failure reason's kind, for the report (reasons carry ids and numbers; kinds do not)."""
    text = reason.lower()
    for kind, words in (
        ("attacker", (MARK,)),
        ("process_killed", ("process killed",)),
        ("aborted_by_decode", ("aborted by the decode",)),
        ("aborted_by_prefill", ("aborted by the prefill",)),
        ("superseded", ("superseded",)),
        ("peer_gone_or_restarted", ("is gone", "restarted", "new instance", "replaced")),
        ("peer_silent", ("silent",)),
        ("write_abandoned", ("abandoned",)),
        ("expired", ("expir", "lease")),
        ("timed_out", ("timed out",)),
        ("source_released", ("already released", "already finished")),
        ("refused", ("refused", "hello", "identity", "not_allowed")),
        ("endpoint_closed", ("closed",)),
        ("wrong_bytes", ("wrong bytes",)),
    ):
        if any(w in text for w in words):
            return kind
    return "other"


FAIL_ON = (
    "leaked_blocks_prefill",
    "leaked_blocks_decode",
    "corrupt_bytes",
    "stale_writes",
    "unauthorized_accepted",
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--faults", choices=["all", "none"], default="all")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--fault-rate", type=float, default=0.08, help="driver faults per request, on top")
    p.add_argument("--prefill-blocks", type=int, default=1024)
    p.add_argument("--decode-blocks", type=int, default=640)
    p.add_argument(
        "--self-check",
        choices=["", *SELF_CHECKS],
        default="",
        help="break the harness on purpose (a wrong byte, a late byte, a lost block, an accepted "
        "handshake) to see the matching counter rise",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    args.argv = getattr(args, "argv", None) or _argv(args)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    soak = Soak(args)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = soak.run()
    finally:
        soak.close()
        signal.signal(signal.SIGTERM, previous)
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    console = Console()
    table = Table(title=f"kvpush soak: {report['requests']} requests, faults {args.faults}, seed {args.seed}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("requests", "completed", "unsettled", *FAIL_ON, "double_returned_blocks"):
        table.add_row(key, str(report[key]))
    table.add_row("failed", str(report["failed_with_reason"]["count"]))
    for kind, count in report["failed_with_reason"]["by_kind"].items():
        table.add_row(f"  failed: {kind}", str(count))
    for kind, count in report["faults_injected"].items():
        table.add_row(f"  fault: {kind}", str(count))
    table.add_row("elapsed s / requests per s", f"{report['elapsed_s']} / {report['requests_per_s']}")
    console.print(table)
    for line in report["notes"][:10]:
        console.print(f"[yellow]{line}")
    bad = [k for k in (*FAIL_ON, "double_returned_blocks", "unsettled") if report[k]]
    if bad:
        console.print(f"[red]soak failed: {', '.join(bad)} not zero")
        return 1
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["--requests", str(args.requests), "--faults", args.faults, "--seed", str(args.seed)]
    if args.json_path:
        out += ["--json", args.json_path]
    if args.self_check:
        out += ["--self-check", args.self_check]
    return out


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt
