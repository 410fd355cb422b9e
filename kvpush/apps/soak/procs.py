"""The soak's three child processes: a prefill and a decode engine (each one endpoint per TP rank over
NIXL/UCX, with a HostKVCache and a FaultInjectingTransport around its NixlTransport) and the attacker.

Each runs a command loop on its main thread; commands come from the driver over a pipe, and everything
the driver needs to account for a block (released, result, stale, faults) goes back the same way."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from kvpush.apps.demo.pattern import count_dirty_bytes, count_wrong_bytes, fill, scrub
from kvpush.apps.demo.procs import Geometry, summed_counters
from kvpush.apps.soak.common import DECODE_ID, PREFILL_ID, soak_config
from kvpush.apps.soak.stream import StreamedPrefill
from kvpush.apps.soak.tap import FrameTapControl
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.endpoint.control import ZmqControl
from kvpush.protocol.groups import flat_ids
from kvpush.protocol.reasons import Failure
from kvpush.transport.base import Transport
from kvpush.transport.faults import FaultInjectingTransport

if TYPE_CHECKING:
    from kvpush.backends.host import HostKVCache


def _nixl_with_faults(
    config: KVPushConfig,
    role: str,
    rank: int,
    rates: dict[str, float],
    seed: int,
    out: list[FaultInjectingTransport],
) -> Callable[[], Transport]:
    def make() -> Transport:
        from kvpush.endpoint.base import new_nixl_transport

        t = FaultInjectingTransport(
            new_nixl_transport(config, role, rank), rates, seed, 1.5 * config.leases.write_timeout_s
        )
        out.append(t)
        return t

    return make


def _send_faults(conn: Connection, injectors: list[FaultInjectingTransport]) -> None:
    for t in injectors:
        counts = t.take_counts()
        if counts:
            conn.send(("faults", counts))


RankResult = tuple[bool, str, Failure | None]  # ok, reason, failure kind


@dataclass
class _RankResults:
    """One engine's per-rank results of a request, gathered until every rank has given its own: the
    driver hears of a request once, as a vLLM scheduler would (ok only if every rank's was)."""

    ranks: int
    got: dict[tuple[str, tuple[int, ...]], list[RankResult]] = field(default_factory=dict)

    def add(
        self, rid: str, blocks: tuple[int, ...], ok: bool, reason: str, failure: Failure | None = None
    ) -> RankResult | None:
        """(ok, reason, failure kind) once every rank gave its own: the first failed rank's reason and kind."""
        seen = self.got.setdefault((rid, blocks), [])
        seen.append((ok, reason, failure))
        if len(seen) < self.ranks:
            return None
        del self.got[(rid, blocks)]
        bad = [r for r in seen if not r[0]]
        return bad[0] if bad else (True, "", None)


def prefill_main(  # noqa: C901
    conn: Connection, geo: Geometry, port: int, rates: dict[str, float], seed: int, check: str
) -> None:
    """The prefill engine, one endpoint per TP rank (the same block ids on every rank, as vLLM's are):
    fills a request's source blocks with its pattern, hands them over, and gives the driver each block
    table back once every rank's endpoint reported the request finished."""
    from kvpush.backends.host import HostKVCache

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    cfg = soak_config(PREFILL_ID, port)
    injectors: list[FaultInjectingTransport] = []
    caches = [HostKVCache(geo.layout(r)) for r in range(geo.tp_size)]
    eps = [
        PrefillEndpoint(
            cfg, c.layout, transport=_nixl_with_faults(cfg, "prefill", r, rates, seed + r, injectors)
        )
        for r, c in enumerate(caches)
    ]
    for ep in eps:
        ep.start()
    streams = [
        StreamedPrefill(ep, c.buffer, c.layout, late_writes=check == "early")
        for ep, c in zip(eps, caches, strict=True)
    ]
    released = _RankResults(geo.tp_size)
    conn.send(("up", eps[0].address))
    try:
        while True:
            if conn.poll(0.002):
                cmd = conn.recv()
                if cmd[0] == "prefill":
                    _, rid, blocks, n, tag, shape, abort_after = cmd
                    for ep, c, st in zip(eps, caches, streams, strict=True):
                        if shape == "whole":
                            fill(c.buffer, c.layout, blocks, n, tag)
                            ep.prefill_done(rid, blocks, n)
                        else:
                            st.start(rid, blocks, n, tag, shape, abort_after)
                elif cmd[0] == "abort":
                    for ep, st in zip(eps, streams, strict=True):
                        ep.abort(cmd[1], "soak: aborted by the prefill engine")
                        st.aborted(cmd[1])  # a streamed request: its prefill_done follows
                elif cmd[0] == "stats":
                    conn.send(
                        ("stats", summed_counters(ep.stats() for ep in eps), sum(ep.pending() for ep in eps))
                    )
                elif cmd[0] == "kept":
                    conn.send(("kept", summed_counters(ep.kept_state() for ep in eps)))
                elif cmd[0] == "stop":
                    break
            for st in streams:
                st.step()
            for rank, st in enumerate(streams):
                for rid, ranges, self_aborted in st.take_ended():
                    if rank == 0:  # every rank streams a request alike: rank 0 speaks for them
                        conn.send(("stream_end", rid, ranges, self_aborted))
            for ep in eps:
                for res in ep.finished():
                    ids = tuple(int(b) for b in flat_ids(res.block_ids)[0])
                    done = released.add(res.request_id, ids, res.ok, res.reason, res.failure)
                    if done is not None:
                        conn.send(("released", res.request_id, *done, list(ids)))
            _send_faults(conn, injectors)
    except (EOFError, OSError):
        pass  # the driver is gone: so are we
    finally:
        for ep in eps:
            ep.close()
        with contextlib.suppress(OSError):
            conn.send(("bye",))


def decode_main(  # noqa: C901
    conn: Connection,
    geo: Geometry,
    prefill: tuple[str, int, int],
    rates: dict[str, float],
    seed: int,
    check: str,
) -> None:
    """The decode engine, one endpoint per TP rank: registers the blocks the driver gives it on every
    rank, verifies every byte of every request all ranks declare ready, scrubs blocks before handing them
    back and checks them when they come again. prefill: (host, base port, prefill TP)."""
    from kvpush.backends.host import HostKVCache

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    caches = [HostKVCache(geo.layout(r)) for r in range(geo.tp_size)]
    cfg = soak_config(DECODE_ID, 0)
    injectors: list[FaultInjectingTransport] = []
    taps = [FrameTapControl(ZmqControl()) for _ in caches]
    eps = [
        DecodeEndpoint(
            cfg,
            c.layout,
            transport=_nixl_with_faults(cfg, "decode", r, rates, seed + r, injectors),
            control=tap,
        )
        for r, (c, tap) in enumerate(zip(caches, taps, strict=True))
    ]
    for ep in eps:
        ep.start()
    addr = PrefillAddress(PREFILL_ID, prefill[0], prefill[1], prefill[2])
    for ep in eps:
        with contextlib.suppress(Exception):  # a frozen or restarting prefill: expect() connects lazily
            ep.connect(addr, timeout=2.0)

    def dirty(blocks: list[int]) -> int:
        return sum(count_dirty_bytes(c.buffer, c.layout, blocks) for c in caches)

    def scrubbed(blocks: list[int]) -> None:
        for c in caches:
            scrub(c.buffer, c.layout, blocks)

    live: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}  # (request, blocks) -> (tokens, tag)
    ready = _RankResults(geo.tp_size)
    conn.send(("up", None))
    try:
        while True:
            if conn.poll(0.002):
                cmd = conn.recv()
                if cmd[0] == "expect":
                    _, rid, blocks, n, tag = cmd
                    found = dirty(blocks)
                    if found:
                        which = [b for b in blocks if dirty([b])]
                        conn.send(("stale", rid, found, f"at reallocation, blocks {which[:8]}"))
                        scrubbed(blocks)
                    live[(rid, tuple(blocks))] = (n, tag)
                    for ep in eps:
                        ep.expect(rid, blocks, n, addr)
                elif cmd[0] == "abort":
                    for ep in eps:
                        ep.abort(cmd[1], "soak: aborted by the decode engine")
                elif cmd[0] == "capture":
                    conn.send(("captured", taps[0].captured()))
                elif cmd[0] == "audit":
                    marked = [b for b in cmd[1] if dirty([b])]
                    conn.send(("audit", dirty(cmd[1]), marked[:20]))
                elif cmd[0] == "audit_lent":  # blocks lent to a cross-peer attack: written? then clean
                    conn.send(("lent_audit", dirty(cmd[1]), cmd[1]))
                    scrubbed(cmd[1])
                elif cmd[0] == "stats":
                    conn.send(
                        ("stats", summed_counters(ep.stats() for ep in eps), sum(ep.pending() for ep in eps))
                    )
                elif cmd[0] == "kept":
                    conn.send(("kept", summed_counters(ep.kept_state() for ep in eps)))
                elif cmd[0] == "stop":
                    break
            for ep in eps:
                for res in ep.finished():
                    ids = tuple(int(b) for b in flat_ids(res.block_ids)[0])  # one group: the table
                    done = ready.add(res.request_id, ids, res.ok, res.reason, res.failure)
                    if done is not None:
                        _report_ready(conn, caches, live, res.request_id, ids, done, check)
            _send_faults(conn, injectors)
    except (EOFError, OSError):
        pass
    finally:
        for ep in eps:
            ep.close()
        with contextlib.suppress(OSError):
            conn.send(("bye",))


def _report_ready(
    conn: Connection,
    caches: list[HostKVCache],
    live: dict[tuple[str, tuple[int, ...]], tuple[int, int]],
    rid: str,
    ids: tuple[int, ...],
    done: RankResult,
    check: str,
) -> None:
    """Every decode rank finished a request: check each rank's bytes if it is ready, scrub its blocks,
    and tell the driver (the blocks are free for it again)."""
    blocks = list(ids)
    n, tag = live.pop((rid, ids), (0, 0))
    ok, reason, failure = done
    wrong = 0
    if ok and n:
        if check == "corrupt":  # self-check: a wrong token where a right one was
            fill(caches[0].buffer, caches[0].layout, blocks[:1], 1, tag + 1)
        wrong = sum(count_wrong_bytes(c.buffer, c.layout, blocks, n, tag) for c in caches)
    for c in caches:
        scrub(c.buffer, c.layout, blocks)
    if check == "stale":  # self-check: a byte lands after the free
        fill(caches[0].buffer, caches[0].layout, blocks[:1], 1, 7)
    conn.send(("result", rid, ok, reason, failure, blocks, wrong, n > 0))


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
