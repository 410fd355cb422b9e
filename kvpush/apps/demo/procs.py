"""The two processes of `kvpush demo`: a prefill engine and a decode engine, each with host KV caches.

Each runs a small command loop on its main thread (commands come from the parent over a pipe) while the
kvpush endpoints' background threads move the KV. Block tables are fragmented on purpose.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.apps.blocks import BlockPool, shuffled_runs
from kvpush.apps.demo.mirror import BlockView, DeviceMirror, LayerUpload, block_view
from kvpush.apps.demo.pattern import copy_layer, count_wrong_bytes, fill, scrub
from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout, TokenOrder, blocks_for, packed_planes
from kvpush.protocol.plan import build_plan


@dataclass(frozen=True)
class Geometry:
    layers: int
    total_kv_heads: int
    head_dim: int
    dtype_size: int
    block_size: int
    num_blocks: int
    tp_size: int
    token_order: TokenOrder = "NHD"
    block_major: bool = False

    def layout(self, rank: int) -> KVLayout:
        return KVLayout(
            num_layers=self.layers,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            total_kv_heads=self.total_kv_heads,
            head_dim=self.head_dim,
            dtype_size=self.dtype_size,
            tp_rank=rank,
            tp_size=self.tp_size,
            token_order=self.token_order,
            block_major=self.block_major,
        )


def _endpoints_config(engine_id: str, port: int, extra: dict[str, Any] | None = None) -> KVPushConfig:
    """The demo's config; `extra`: settings from the demo's flags (post_workers, posted_nudge, ...)."""
    return KVPushConfig.from_mapping(
        {"engine_id": engine_id, "port": port, "lease_s": 60.0, "ready_timeout_s": 90.0, **(extra or {})}
    )


class BlockMajorHostCache:
    """A host cache with the block-outermost placement (every layer's K and V of a block in one run).

    HostKVCache sizes its buffer for layer-major planes; this one sizes it from layout.cache_bytes."""

    mem_type = "DRAM"

    def __init__(self, layout: KVLayout) -> None:
        self._mmap = mmap.mmap(-1, max(layout.cache_bytes, 1))
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8, count=layout.cache_bytes)
        self.buffer.fill(0)  # prefault, as HostKVCache does
        self.layout = packed_planes(layout, int(self.buffer.ctypes.data))

    def to_host(self) -> np.ndarray:
        return self.buffer

    def from_host(self, host: np.ndarray) -> None:
        if host is not self.buffer:
            self.buffer[:] = host


def make_cache(layout: KVLayout, device: str) -> Any:
    """Host DRAM or CUDA VRAM (--device cuda: every rank on GPU 0 unless more are visible)."""
    if layout.block_major:
        if device != "cpu":
            raise ValueError("--layout block-major is implemented for --device cpu only")
        return BlockMajorHostCache(layout)
    if device == "cuda":
        import torch

        from kvpush.backends.cuda import CudaKVCache

        return CudaKVCache(layout, layout.tp_rank % max(1, torch.cuda.device_count()))
    return HostKVCache(layout)


def summed_counters(per_rank: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Per-rank counters added up, key by key (what a process of several ranks reports as one engine;
    zeros kept, unlike Counter's addition)."""
    agg: dict[str, int] = {}
    for counts in per_rank:
        for k, v in counts.items():
            agg[k] = agg.get(k, 0) + v
    return agg


def _stats_reply(eps: list[Any], alloc: BlockPool, geo: Geometry) -> tuple[Any, ...]:
    """Counters summed over this process's ranks, and how many blocks are free (all, if none leaked)."""
    return ("stats", summed_counters(ep.stats() for ep in eps), alloc.num_free, geo.num_blocks)


def _shut_down(conn: Connection, eps: list[Any], raw: Any) -> None:
    """Close the endpoints and the raw-measurement agent, then tell the parent this process is done."""
    for ep in eps:
        ep.close()
    if raw is not None:
        raw.close()
    conn.send(("bye",))


def _raw_transport(name: str, cache: Any) -> Any:
    from kvpush.transport.nixl import NixlTransport

    t = NixlTransport(name)
    t.register(cache.layout.regions, cache.mem_type)
    return t


def _reference(
    raw: Any,
    cache: Any,
    kind: str,
    peer: str,
    label: str,
    dst_layout: KVLayout,
    src_blocks: list[int],
    dst_blocks: list[int],
    n: int,
) -> tuple[Any, ...]:
    """NIXL's own references for one request, rank 0 -> rank 0, timed from the post to the decode's
    notification: (a) one prepared single-descriptor handle of the request's size, reposted; (b) the paged
    descriptor list kvpush's plan would post (build_plan's maximal runs), prepared once and reposted.
    Both are made and posted once untimed first, as a benchmark's warm-up does."""
    plan = build_plan(cache.layout, dst_layout, src_blocks, dst_blocks, n)
    if kind == "a":
        src = np.array([[cache.layout.regions[0].addr, plan.nbytes, cache.layout.regions[0].device_id]])
        dst = np.array([[dst_layout.regions[0].addr, plan.nbytes, dst_layout.regions[0].device_id]])
    else:
        src, dst = plan.nixl_descs()
    src, dst = src.astype(np.int64), dst.astype(np.int64)
    local = raw.prepare(None, src, cache.mem_type)
    remote = raw.prepare(peer, dst, cache.mem_type)
    idx = np.arange(src.shape[0], dtype=np.int32)
    h = raw.make_write(local, idx, remote, idx, (label + "-warm").encode())
    raw.repost(h)
    while raw.poll(h) == "PROC":
        pass
    at = time.monotonic()
    raw.repost(h, label.encode())
    while raw.poll(h) == "PROC":
        pass
    done = time.monotonic()
    raw.release(h)
    raw.release_prepared(local)
    raw.release_prepared(remote)
    return ("ref_done", at, done, plan.nbytes, src.shape[0])


_STAGING: dict[
    int, npt.NDArray[np.uint8]
] = {}  # cache id -> a host buffer of its layout where patterns are made


def layered_prefill(
    eps: list[Any],
    caches: list[Any],
    views: list[BlockView],
    rid: str,
    blocks: list[int],
    n: int,
    tag: int,
    per_layer_s: float,
    streamed: bool,
) -> tuple[float, float]:
    """A synthetic prefill, layer by layer: each layer's compute (a sleep: on a GPU the host is free while
    the kernels run), then its KV written (the layer's blocks copied in from a pattern made beforehand),
    then, streamed, reported ready with kv_ready;
    prefill_done after the last layer. Returns (start, end): monotonic, end = the last layer written.
    On CUDA caches the compute is a kernel delay on the device (see _cuda_layered_prefill)."""
    if getattr(caches[0], "device_type", "") == "cuda":
        return _cuda_layered_prefill(eps, caches, views, rid, blocks, n, tag, per_layer_s, streamed)
    hosts = [c.to_host() for c in caches]
    for c, h in zip(caches, hosts, strict=True):
        if id(c) not in _STAGING:
            _STAGING[id(c)] = np.zeros_like(h)
    staged = [_STAGING[id(c)] for c in caches]
    for c, stage in zip(caches, staged, strict=True):  # the pattern is made before the prefill starts
        fill(stage, c.layout, blocks, n, tag)  # (not timed) ...
    start = time.monotonic()
    for layer in range(caches[0].layout.num_layers):
        time.sleep(per_layer_s)
        for c, host, stage in zip(caches, hosts, staged, strict=True):  # ... and lands layer by layer
            copy_layer(host, stage, c.layout, blocks, layer)
            c.from_host(host)
        if streamed:
            for ep in eps:
                ep.kv_ready(rid, blocks, n, layers=(layer, layer + 1))
    end = time.monotonic()
    for ep in eps:
        ep.prefill_done(rid, blocks, n)
    return start, end


_SLEEP_RATE: dict[int, float] = {}


def sleep_cycles_per_s(dev: int) -> float:
    """torch.cuda._sleep cycles per second on this device, measured once (a kernel of 10M cycles after a
    warm-up one): the SM clock differs between idle and loaded cards, so cycles are not a fixed time."""
    if dev not in _SLEEP_RATE:
        import torch

        with torch.cuda.device(dev):
            torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]  # the first launch loads the kernel
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            a.record()
            torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
            b.record()
            b.synchronize()
            _SLEEP_RATE[dev] = 10_000_000 / max(a.elapsed_time(b) * 1e-3, 1e-6)
    return _SLEEP_RATE[dev]


def _cuda_layered_prefill(
    eps: list[Any],
    caches: list[Any],
    views: list[BlockView],
    rid: str,
    blocks: list[int],
    n: int,
    tag: int,
    per_layer_s: float,
    streamed: bool,
) -> tuple[float, float]:
    """The GPU form: the pattern is made in the host mirror of the request's blocks first, and their rows
    pinned (not timed); then per layer, on the device's stream, a kernel that spins per_layer_s
    (torch.cuda._sleep), that layer's rows of the request's blocks copied in (mirror.LayerUpload), and a
    CUDA event whose synchronize is the range's kv_written barrier: the engine thread only enqueues, the
    push thread waits on the event. `end` is when the last layer's event completed."""
    import torch

    uploads = []
    for c, view in zip(caches, views, strict=True):
        if not isinstance(view, DeviceMirror):
            raise ValueError("the streamed demo on CUDA needs a cache in one tensor with packed planes")
        fill(view.pull(blocks), c.layout, blocks, n, tag)
        uploads.append(LayerUpload(view, blocks, c.layout.num_layers))
    dev = caches[0].device
    cycles = int(per_layer_s * sleep_cycles_per_s(dev))
    for c in caches:
        torch.cuda.synchronize(c.device)
    start = time.monotonic()
    events: list[Any] = [None] * len(caches)
    for layer in range(caches[0].layout.num_layers):
        for i, (c, upload) in enumerate(zip(caches, uploads, strict=True)):
            with torch.cuda.device(c.device):
                if cycles:
                    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
                upload.enqueue(layer)
                events[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
                events[i].record()
        if streamed:
            for ep, ev in zip(eps, events, strict=True):
                ep.kv_ready(rid, blocks, n, layers=(layer, layer + 1), kv_written=ev.synchronize)
    for ep, ev in zip(eps, events, strict=True):
        ep.prefill_done(rid, blocks, n, kv_written=ev.synchronize)
    for ev in events:
        ev.synchronize()
    return start, time.monotonic()


def _logging() -> None:
    level = os.environ.get("KVPUSH_LOG")
    if level:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(processName)s %(message)s")


def prefill_main(  # noqa: C901
    conn: Connection,
    geo: Geometry,
    port: int,
    seed: int,
    run: int,
    device: str,
    extra: dict[str, Any] | None = None,
) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    _logging()
    caches = [make_cache(geo.layout(r), device) for r in range(geo.tp_size)]
    views = [block_view(c) for c in caches]  # a request's blocks to and from the host, not whole caches
    cfg = _endpoints_config("demo-prefill", port, extra)
    eps = [PrefillEndpoint(cfg, c.layout, c.mem_type) for c in caches]
    for ep in eps:
        ep.start()
    alloc = BlockPool(geo.num_blocks, shuffled_runs(geo.num_blocks, seed, run), reverse_free=False)
    live: dict[str, tuple[list[int], int, set[int], list[str], dict[str, float]]] = {}
    raw: Any = None
    conn.send(("up", eps[0].address))
    try:
        while True:
            if conn.poll(0.001):
                cmd = conn.recv()
                kind = cmd[0]
                if kind == "prepare":  # the "compute": allocate and write this request's KV
                    _, rid, n, tag, *source = cmd
                    blocks = alloc.allocate(blocks_for(n, geo.block_size))
                    if source and source[0]:  # named as the compute starts: a WRITE may be made ahead
                        for ep in eps:
                            ep.source_blocks(rid, blocks, n)
                    for c, view in zip(caches, views, strict=True):
                        fill(view.pull(blocks), c.layout, blocks, n, tag)
                        view.push(blocks)
                    live[rid] = (blocks, n, set(), [], {})
                    conn.send(("prepared", rid, blocks))
                elif kind == "caps":  # what the streamed demo may call on this build's endpoints
                    conn.send(("caps", all(hasattr(ep, "kv_ready") for ep in eps)))
                elif kind == "prefill_layers":  # a layer-by-layer prefill (kvpush demo --stream)
                    _, rid, n, tag, per_layer_s, streamed = cmd
                    blocks = alloc.allocate(blocks_for(n, geo.block_size))
                    live[rid] = (blocks, n, set(), [], {})
                    start, end = layered_prefill(
                        eps, caches, views, rid, blocks, n, tag, per_layer_s, streamed
                    )
                    conn.send(("prefilled_layers", rid, start, end, blocks))
                elif kind == "prefill_done":
                    rid = cmd[1]
                    blocks, n = live[rid][0], live[rid][1]
                    at = time.monotonic()
                    for ep in eps:
                        ep.prefill_done(rid, blocks, n)
                    # the engine's own time in prefill_done (an inline post runs on this thread)
                    conn.send(("prefilled", rid, at, time.monotonic() - at))
                elif kind == "stats":
                    conn.send(_stats_reply(eps, alloc, geo))
                elif kind == "raw_peer":
                    raw = raw or _raw_transport("demo-raw-prefill", caches[0])
                    conn.send(("raw_peer", raw.add_peer(cmd[1])))
                elif kind == "ref":
                    conn.send(_reference(raw, caches[0], *cmd[1:]))
                elif kind == "raw_write":
                    _, peer, dst_addr, dst_dev, nbytes, label = cmd
                    region = caches[0].layout.regions[0]
                    src = np.array([[region.addr, nbytes, region.device_id]], dtype=np.int64)
                    dst = np.array([[dst_addr, nbytes, dst_dev]], dtype=np.int64)
                    at = time.monotonic()
                    h = raw.post_write(peer, src, dst, label.encode(), caches[0].mem_type)
                    while raw.poll(h) == "PROC":
                        time.sleep(20e-6)
                    raw.release(h)
                    conn.send(("raw_written", at, time.monotonic()))
                elif kind == "stop":
                    break
            for rank, ep in enumerate(eps):
                for res in ep.finished():
                    entry = live.get(res.request_id)
                    if entry is None:
                        continue
                    entry[2].add(rank)
                    if not res.ok:
                        entry[3].append(res.reason)
                    if rank == 0:
                        entry[4].update(res.timeline)
                    if len(entry[2]) == len(eps):
                        del live[res.request_id]
                        alloc.free(entry[0])
                        conn.send(("released", res.request_id, not entry[3], "; ".join(entry[3]), entry[4]))
    finally:
        _shut_down(conn, eps, raw)


def decode_main(conn: Connection, geo: Geometry, seed: int, run: int, prefill_tp: int, device: str) -> None:  # noqa: C901
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    _logging()
    caches = [make_cache(geo.layout(r), device) for r in range(geo.tp_size)]
    views = [block_view(c) for c in caches]
    cfg = _endpoints_config("demo-decode", 0)
    eps = [DecodeEndpoint(cfg, c.layout, c.mem_type) for c in caches]
    for ep in eps:
        ep.start()
    alloc = BlockPool(geo.num_blocks, shuffled_runs(geo.num_blocks, seed + 1, run), reverse_free=False)
    live: dict[str, dict[str, Any]] = {}
    raw: Any = None
    conn.send(("up", None))
    try:
        while True:
            if conn.poll(0.001):
                cmd = conn.recv()
                kind = cmd[0]
                if kind == "connect":
                    addr = PrefillAddress("demo-prefill", cmd[1][0], cmd[1][1], prefill_tp)
                    for ep in eps:
                        ep.connect(addr)
                    conn.send(("connected",))
                elif kind == "expect":
                    _, rid, n, tag, (host, port) = cmd
                    blocks = alloc.allocate(blocks_for(n, geo.block_size))
                    live[rid] = {"blocks": blocks, "n": n, "tag": tag, "done": {}, "at": time.monotonic()}
                    addr = PrefillAddress("demo-prefill", host, port, prefill_tp)
                    for ep in eps:
                        ep.expect(rid, blocks, n, addr)
                    conn.send(("expected", rid, live[rid]["at"], blocks))
                elif kind == "verify":  # outside the timed part: check every byte, scrub, free
                    entry = live.pop(cmd[1])
                    wrong = -1
                    hosts = [view.pull(entry["blocks"]) for view in views]
                    if entry.get("ok"):
                        wrong = sum(
                            count_wrong_bytes(h, c.layout, entry["blocks"], entry["n"], entry["tag"])
                            for h, c in zip(hosts, caches, strict=True)
                        )
                    for h, c, view in zip(hosts, caches, views, strict=True):
                        scrub(h, c.layout, entry["blocks"])
                        view.push(entry["blocks"])
                    alloc.free(entry["blocks"])
                    conn.send(("verified", cmd[1], wrong))
                elif kind == "raw_md":
                    raw = raw or _raw_transport("demo-raw-decode", caches[0])
                    region = caches[0].layout.regions[0]
                    conn.send(("raw_md", raw.metadata(), region.addr, region.device_id, caches[0].layout))
                elif kind == "raw_wait":
                    label = cmd[1].encode()
                    while True:
                        got = [m for _p, m in raw.drain_notifs() if m == label]
                        if got:
                            conn.send(("raw_notified", time.monotonic()))
                            break
                        time.sleep(20e-6)
                elif kind == "scrub":  # after the references wrote into freed blocks
                    for c, view in zip(caches, views, strict=True):
                        scrub(view.pull(cmd[1]), c.layout, cmd[1])
                        view.push(cmd[1])
                    conn.send(("scrubbed",))
                elif kind == "stats":
                    conn.send(_stats_reply(eps, alloc, geo))
                elif kind == "stop":
                    break
            for rank, ep in enumerate(eps):
                for res in ep.finished():
                    pending = live.get(res.request_id)
                    if pending is None:
                        continue
                    entry = pending
                    entry["done"][rank] = res
                    if len(entry["done"]) < len(eps):
                        continue
                    results = list(entry["done"].values())
                    entry["ok"] = all(r.ok for r in results)
                    conn.send(
                        (
                            "ready",
                            res.request_id,
                            entry["ok"],
                            "; ".join(r.reason for r in results if r.reason),
                            max(r.ready_at for r in results),
                            sum(r.nbytes for r in results),
                        )
                    )
    finally:
        _shut_down(conn, eps, raw)
