"""The soak's three child processes: a prefill and a decode engine (each one endpoint over NIXL/UCX with
a HostKVCache and a FaultInjectingTransport around its NixlTransport) and the attacker.

Each runs a command loop on its main thread; commands come from the driver over a pipe, and everything
the driver needs to account for a block (released, result, stale, faults) goes back the same way."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from multiprocessing.connection import Connection

from kvpush.apps.demo.pattern import count_dirty_bytes, count_wrong_bytes, fill, scrub
from kvpush.apps.demo.procs import Geometry
from kvpush.apps.soak.common import DECODE_ID, PREFILL_ID, soak_config
from kvpush.apps.soak.stream import StreamedPrefill
from kvpush.apps.soak.tap import FrameTapControl
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.endpoint.control import ZmqControl
from kvpush.protocol.groups import flat_ids
from kvpush.transport.base import Transport
from kvpush.transport.faults import FaultInjectingTransport


def _nixl_with_faults(
    config: KVPushConfig, role: str, rates: dict[str, float], seed: int, out: list[FaultInjectingTransport]
) -> Callable[[], Transport]:
    def make() -> Transport:
        from kvpush.endpoint.base import new_nixl_transport

        t = FaultInjectingTransport(
            new_nixl_transport(config, role, 0), rates, seed, 1.5 * config.leases.write_timeout_s
        )
        out.append(t)
        return t

    return make


def _send_faults(conn: Connection, injectors: list[FaultInjectingTransport]) -> None:
    for t in injectors:
        counts = t.take_counts()
        if counts:
            conn.send(("faults", counts))


def prefill_main(
    conn: Connection, geo: Geometry, port: int, rates: dict[str, float], seed: int, check: str
) -> None:
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
    streams = StreamedPrefill(ep, cache.buffer, cache.layout, late_writes=check == "early")
    conn.send(("up", ep.address))
    try:
        while True:
            if conn.poll(0.002):
                cmd = conn.recv()
                if cmd[0] == "prefill":
                    _, rid, blocks, n, tag, shape, abort_after = cmd
                    if shape == "whole":
                        fill(cache.buffer, cache.layout, blocks, n, tag)
                        ep.prefill_done(rid, blocks, n)
                    else:
                        streams.start(rid, blocks, n, tag, shape, abort_after)
                elif cmd[0] == "abort":
                    ep.abort(cmd[1], "soak: aborted by the prefill engine")
                    streams.aborted(cmd[1])  # a streamed request: its prefill_done follows
                elif cmd[0] == "stats":
                    conn.send(("stats", ep.stats(), ep.pending()))
                elif cmd[0] == "kept":
                    conn.send(("kept", ep.kept_state()))
                elif cmd[0] == "stop":
                    break
            streams.step()
            for rid, ranges, self_aborted in streams.take_ended():
                conn.send(("stream_end", rid, ranges, self_aborted))
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
                elif cmd[0] == "audit_lent":  # blocks lent to a cross-peer attack: written? then clean
                    conn.send(("lent_audit", count_dirty_bytes(buf, layout, cmd[1]), cmd[1]))
                    scrub(buf, layout, cmd[1])
                elif cmd[0] == "stats":
                    conn.send(("stats", ep.stats(), ep.pending()))
                elif cmd[0] == "kept":
                    conn.send(("kept", ep.kept_state()))
                elif cmd[0] == "stop":
                    break
            for res in ep.finished():
                blocks = [int(b) for b in flat_ids(res.block_ids)[0]]  # one group: the table itself
                n, tag = live.pop((res.request_id, tuple(blocks)), (0, 0))
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


def attacker_main(conn: Connection, port: int, self_check_key: bytes | None, holder_key: bytes) -> None:
    """The attacker: plays each attack the driver asks for and reports what it sent and what answered."""
    import zmq

    from kvpush.apps.soak.attacker import Attacker

    ctx = zmq.Context()
    attacker = Attacker(ctx, port, self_check_key, holder_key)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "holder":
                _, kind, targets, blocks, captured = cmd
                nframes, accepted = attacker.play_holder(kind, targets, blocks, captured)
                conn.send(("held_attack", kind, nframes, accepted, blocks))
                continue
            _, kind, rid, blocks, captured = cmd
            nframes, accepted = attacker.play(kind, rid, blocks, captured)
            conn.send(("attacked", kind, nframes, accepted))
    except (EOFError, OSError):
        pass
    finally:
        ctx.term()
