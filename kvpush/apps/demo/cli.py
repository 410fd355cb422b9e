"""`kvpush demo`: push N requests from a prefill process to a decode process over real NIXL, verify
every destination byte, and report throughput against NIXL's own references measured in the same run,
request by request between the same two processes:

  (a) one prepared single-descriptor handle of the request's size, reposted (NIXL's benchmark default);
  (b) the paged descriptor list kvpush's plan posts for that request, prepared once and reposted (NIXL's
      floor for that fragmentation);
  (c) kvpush itself.

(c)/(a) is what fragmentation and kvpush cost together; (c)/(b) is kvpush's own overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpush.apps.cliutil import (
    add_output_flags,
    alias,
    emit_json,
    non_negative_int,
    port,
    positive_int,
    text_to_stderr,
)
from kvpush.apps.demo import stream
from kvpush.apps.demo.procs import Geometry, decode_main, prefill_main
from kvpush.apps.demo.timeline import timeline_us
from kvpush.apps.ports import free_port_range
from kvpush.protocol.layout import blocks_for


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-prompts", dest="requests", metavar="N", type=positive_int, default=64, help="requests to push"
    )
    alias(p, "--requests", "requests", type=positive_int)
    p.add_argument("--max-tokens", type=positive_int, default=16384)
    p.add_argument("--min-tokens", type=positive_int, default=16)
    p.add_argument("--prefill-block-size", type=positive_int, default=16)
    p.add_argument("--decode-block-size", type=positive_int, default=32)
    p.add_argument("--prefill-tp", type=positive_int, default=1)
    p.add_argument("--decode-tp", type=positive_int, default=1)
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--kv-heads", type=positive_int, default=1, help="total KV heads (split over TP)")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--dtype-size", type=positive_int, default=2)
    p.add_argument("--token-order", choices=["NHD", "HND"], default="NHD")
    p.add_argument("--window", type=positive_int, default=4, help="requests in flight at once")
    p.add_argument(
        "--run-blocks",
        type=positive_int,
        default=8,
        help="free lists are shuffled runs of this many blocks (1 = fully random)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=port, default=0, help="prefill side-channel base port (0: pick free)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the KV caches live: host DRAM or CUDA VRAM (registered as VRAM)",
    )
    p.add_argument(
        "--layout",
        choices=["layer-major", "block-major"],
        default="layer-major",
        help="cache placement: per-layer planes, or block-outermost (every layer of a block in one run)",
    )
    p.add_argument(
        "--no-references",
        dest="references",
        action="store_false",
        help="skip NIXL's references (a) and (b) after each wave",
    )
    p.add_argument(
        "--post-workers",
        type=non_negative_int,
        default=None,
        help="prefill posting threads (config post_workers; 0: the push thread posts; default: config's)",
    )
    p.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="prefill push thread: keep polling this long after activity before blocking (config spin_s)",
    )
    p.add_argument(
        "--no-nudge",
        dest="nudge",
        action="store_false",
        help="prefill sends no Posted nudge after posting (config posted_nudge=False)",
    )
    p.add_argument(
        "--no-engine-post",
        dest="engine_post_max_bytes",
        action="store_const",
        const=0,
        help="prefill_done always hands WRITEs made ahead to the push thread (--engine-post-max-bytes 0)",
    )
    p.add_argument(
        "--engine-post-max-bytes",
        type=int,
        default=None,
        help="config engine_post_max_bytes: the largest armed WRITE prefill_done posts on the engine's thread "
        "(on loopback the copy runs inside that post, so the engine's thread pays it)",
    )
    p.add_argument(
        "--no-source-blocks",
        dest="source_blocks",
        action="store_false",
        help="prefill does not name each prompt's source blocks before prefill_done (no armed WRITEs)",
    )
    add_output_flags(p, "the result summary", "--output-json")
    stream.configure(p)


@dataclass
class _Req:
    rid: str
    n: int
    tag: int
    reg_first: bool
    expect_at: float = 0.0
    prefill_at: float = 0.0
    ready_at: float = 0.0
    ok: bool | None = None
    released: bool = False
    nbytes: int = 0
    wrong: int = -1
    reason: str = ""
    p_blocks: list[int] | None = None
    d_blocks: list[int] | None = None
    timeline: dict[str, float] | None = None
    ref_s: dict[str, float] | None = None  # reference kind -> post to notification, seconds
    ref_bytes: int = 0
    ref_descs: int = 0
    call_s: float = 0.0  # the engine's time inside prefill_done (its own thread)


class _Peers:
    """The parent's view of the two child processes: send a command, wait for a kind of reply."""

    def __init__(self, prefill: Connection, decode: Connection) -> None:
        self.p, self.d = prefill, decode
        self.backlog: list[tuple[Connection, Any]] = []

    def expect_reply(self, conn: Connection, kind: str, timeout: float = 120.0) -> Any:
        for i, (c, msg) in enumerate(self.backlog):
            if c is conn and msg[0] == kind:
                del self.backlog[i]
                return msg
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                msg = conn.recv()
                if msg[0] == kind:
                    return msg
                self.backlog.append((conn, msg))
        raise TimeoutError(f"no {kind!r} reply within {timeout}s")


def run(args: argparse.Namespace) -> int:
    with text_to_stderr(args):  # --json: stdout carries only the summary
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.stream:
        return stream.run_stream(args, _prefill_extra(args))
    if args.min_tokens < 1 or args.max_tokens < args.min_tokens:
        raise SystemExit("--min-tokens must be >= 1 and <= --max-tokens")
    rng = random.Random(args.seed)
    reqs = [
        _Req(f"req-{i}", rng.randint(args.min_tokens, args.max_tokens), i + 1, i % 2 == 0)
        for i in range(args.requests)
    ]
    rng.shuffle(reqs)
    slack = 1.5
    p_blocks = int(args.window * blocks_for(args.max_tokens, args.prefill_block_size) * slack) + 64
    d_blocks = int(args.window * blocks_for(args.max_tokens, args.decode_block_size) * slack) + 64
    common = dict(
        layers=args.layers,
        total_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype_size=args.dtype_size,
        token_order=args.token_order,
        block_major=args.layout == "block-major",
    )
    p_geo = Geometry(
        block_size=args.prefill_block_size, num_blocks=p_blocks, tp_size=args.prefill_tp, **common
    )
    d_geo = Geometry(block_size=args.decode_block_size, num_blocks=d_blocks, tp_size=args.decode_tp, **common)
    port = args.port or free_port_range(args.prefill_tp)

    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    p_proc = ctx.Process(
        target=prefill_main,
        args=(p_child, p_geo, port, args.seed, args.run_blocks, args.device, _prefill_extra(args)),
        name="kvpush-demo-prefill",
    )
    d_proc = ctx.Process(
        target=decode_main,
        args=(d_child, d_geo, args.seed, args.run_blocks, args.prefill_tp, args.device),
        name="kvpush-demo-decode",
    )
    p_proc.start()
    d_proc.start()
    peers = _Peers(p_conn, d_conn)
    try:
        address = tuple(peers.expect_reply(p_conn, "up")[1])
        peers.expect_reply(d_conn, "up")
        d_conn.send(("connect", address))
        peers.expect_reply(d_conn, "connected")
        ref = _raw_handshake(peers) if args.references else None
        _drive(peers, reqs, address, args.window, console, ref, args.source_blocks)
        p_conn.send(("stats",))
        d_conn.send(("stats",))
        p_stats = peers.expect_reply(p_conn, "stats")
        d_stats = peers.expect_reply(d_conn, "stats")
    finally:
        for conn in (p_conn, d_conn):
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
        for proc in (p_proc, d_proc):
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
    return _report(args, reqs, p_stats, d_stats, console)


def _prefill_extra(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"posted_nudge": args.nudge}
    if args.post_workers is not None:
        extra["post_workers"] = args.post_workers
    if args.spin_us is not None:
        extra["spin_s"] = args.spin_us * 1e-6
    if args.engine_post_max_bytes is not None:
        extra["engine_post_max_bytes"] = args.engine_post_max_bytes
    return extra


def _raw_handshake(peers: _Peers) -> tuple[str, Any]:
    """A second pair of plain NIXL agents in the same two processes, for the references."""
    peers.d.send(("raw_md",))
    _, md, _dst_addr, _dst_dev, dst_layout = peers.expect_reply(peers.d, "raw_md")
    peers.p.send(("raw_peer", md))
    peer = peers.expect_reply(peers.p, "raw_peer")[1]
    return peer, dst_layout


def _references(peers: _Peers, r: _Req, ref: tuple[str, Any]) -> None:
    """(a) and (b) for one request (see the module docstring), timed post -> decode notification."""
    peer, dst_layout = ref
    r.ref_s = {}
    for kind in ("a", "b"):
        label = f"ref-{kind}-{r.rid}"
        peers.d.send(("raw_wait", label))
        peers.p.send(("ref", kind, peer, label, dst_layout, r.p_blocks, r.d_blocks, r.n))
        _, at, _done, nbytes, ndesc = peers.expect_reply(peers.p, "ref_done")
        notified_at = peers.expect_reply(peers.d, "raw_notified")[1]
        r.ref_s[kind] = max(notified_at - at, 1e-9)
        r.ref_bytes = nbytes
        if kind == "b":
            r.ref_descs = ndesc
    peers.d.send(("scrub", r.d_blocks))
    peers.expect_reply(peers.d, "scrubbed")


def _drive(  # noqa: C901
    peers: _Peers,
    reqs: list[_Req],
    address: tuple[Any, ...],
    window: int,
    console: Console,
    ref: tuple[str, Any] | None,
    source_blocks: bool = True,
) -> None:
    """Run the requests in waves of `window`.

    Per wave: prefill computes (fills) every request's KV first and decode allocates; then the hand-offs
    go out in each request's event order and the transfers overlap; the byte-by-byte verification runs
    after the wave, so the harness's own numpy work never competes with the transfers it times.
    """
    with Progress(
        TextColumn("push"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("requests", total=len(reqs))
        for start in range(0, len(reqs), window):
            wave = reqs[start : start + window]
            for r in wave:
                peers.p.send(("prepare", r.rid, r.n, r.tag, source_blocks))
            for _ in wave:
                _, rid, blocks = peers.expect_reply(peers.p, "prepared")
                next(x for x in wave if x.rid == rid).p_blocks = blocks
            for r in wave:
                if r.reg_first:
                    peers.d.send(("expect", r.rid, r.n, r.tag, address))
                    _, _, r.expect_at, r.d_blocks = peers.expect_reply(peers.d, "expected")
                    time.sleep(0.002)  # let the registration reach prefill before prefill_done
                    peers.p.send(("prefill_done", r.rid))
                    _, _, r.prefill_at, r.call_s = peers.expect_reply(peers.p, "prefilled")
                else:
                    peers.p.send(("prefill_done", r.rid))
                    _, _, r.prefill_at, r.call_s = peers.expect_reply(peers.p, "prefilled")
                    peers.d.send(("expect", r.rid, r.n, r.tag, address))
                    _, _, r.expect_at, r.d_blocks = peers.expect_reply(peers.d, "expected")
            for _ in wave:
                _, rid, ok, reason, ready_at, nbytes = peers.expect_reply(peers.d, "ready")
                r = next(x for x in wave if x.rid == rid)
                r.ok, r.reason, r.ready_at, r.nbytes = ok, reason, ready_at, nbytes
            for _ in wave:
                msg = peers.expect_reply(peers.p, "released")
                r = next(x for x in wave if x.rid == msg[1])
                r.released = True
                r.timeline = msg[4]
                if not msg[2]:
                    r.reason = r.reason or msg[3]
            for r in wave:
                peers.d.send(("verify", r.rid))
                r.wrong = peers.expect_reply(peers.d, "verified")[2]
            if ref is not None:  # same blocks, same processes, right after kvpush moved them
                for r in wave:
                    if r.ok:
                        _references(peers, r, ref)
            for _ in wave:
                bar.advance(task)


def _busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _p99(values: list[float]) -> float:
    if len(values) > 1:
        return statistics.quantiles(values, n=100)[98]
    return values[0] if values else 0.0


def _report(args: argparse.Namespace, reqs: list[_Req], p_stats: Any, d_stats: Any, console: Console) -> int:
    verified = sum(1 for r in reqs if r.ok and r.wrong == 0)
    failed = sum(1 for r in reqs if not r.ok)
    total_bytes = sum(r.nbytes for r in reqs if r.ok)
    # the prompt's bytes, all heads: kvpush's prepared path moves whole units, so its own count can
    # exceed this by the rest of a request's last unit; GB/s is reported on the prompt's bytes
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * args.dtype_size
    prompt_bytes = sum(r.n * per_token for r in reqs if r.ok)
    lat = [(r.ready_at - r.prefill_at) * 1000 for r in reqs if r.ok]
    spans = [(max(r.prefill_at, r.expect_at), r.ready_at) for r in reqs if r.ok]
    gbps = prompt_bytes / max(_busy_union(spans), 1e-9) / 1e9
    refs = [r for r in reqs if r.ok and r.ref_s]
    ref_gbps = {
        k: sum(r.ref_bytes for r in refs) / max(sum(r.ref_s[k] for r in refs if r.ref_s), 1e-9) / 1e9
        for k in ("a", "b")
    }
    pst = p_stats[1]
    small = [r for r in reqs if r.n <= 1024]
    summary = {
        "device": args.device,
        "layout": args.layout,
        "prefill_config": _prefill_extra(args),
        "requests": len(reqs),
        "verified": verified,
        "failed": failed,
        "bytes": total_bytes,
        "prompt_bytes": prompt_bytes,
        "gbps": round(gbps, 3),
        "ref_a_gbps": round(ref_gbps["a"], 3) if refs else None,
        "ref_b_gbps": round(ref_gbps["b"], 3) if refs else None,
        "c_over_a": round(gbps / ref_gbps["a"], 3) if refs else None,
        "c_over_b": round(gbps / ref_gbps["b"], 3) if refs else None,
        "ref_b_descriptors": sum(r.ref_descs for r in refs),
        "references_over": "rank 0 -> rank 0 share, one request at a time, post -> decode notification",
        "descriptors": pst["descriptors"],
        "blocks": pst["blocks"],
        # descriptors held in prepared lists: strided rows (NIXL >= 1.5) or one per unit (1.3.x)
        "prepared_lists": pst["prepared_lists"],
        "prepared_descriptors": pst["prepared_descriptors"],
        "ready_after_prefill_ms": {
            "p50": round(statistics.median(lat), 3) if lat else 0.0,
            "p99": round(_p99(lat), 3),
        },
        "timeline_p50_us": timeline_us((r.timeline, r.ready_at if r.ok else 0.0) for r in reqs),
        "timeline_p50_us_small": timeline_us((r.timeline, r.ready_at if r.ok else 0.0) for r in small),
        # the small requests whose WRITE was made ahead (source_blocks, then registration, then
        # prefill_done): prefill_done only posted it
        "timeline_p50_us_small_armed": timeline_us(
            (r.timeline, r.ready_at if r.ok else 0.0) for r in small if r.timeline and "armed" in r.timeline
        ),
        "source_blocks": args.source_blocks,
        # what the engine's thread spent inside prefill_done, small requests (an inline post runs there)
        "prefill_done_call_us_small": {
            "p50": round(1e6 * statistics.median([r.call_s for r in small]), 1) if small else 0.0,
            "p99": round(1e6 * _p99([r.call_s for r in small]), 1),
        },
        "armed": pst.get("armed", 0),
        "engine_posts": pst.get("engine_posts", 0),  # armed WRITEs posted on the engine's thread
        "event_orders": {
            "registration_first": pst["registration_first"],
            "prefill_first": pst["prefill_first"],
        },
        "wire_errors": pst["wire_errors"] + d_stats[1]["wire_errors"],
        "blocks_free_after": {"prefill": [p_stats[2], p_stats[3]], "decode": [d_stats[2], d_stats[3]]},
    }
    where = "host DRAM" if args.device == "cpu" else "CUDA VRAM"
    table = Table(
        title=f"kvpush demo: prefill -> decode push over NIXL (UCX, {where}, {args.layout}, 127.0.0.1)"
    )
    for col in (
        "requests",
        "verified",
        "failed",
        "GiB",
        "(c) kvpush GB/s",
        "(a) 1-desc GB/s",
        "(b) paged GB/s",
        "(c)/(a)",
        "(c)/(b)",
        "descriptors / blocks",
        "ready after prefill p50 / p99 ms",
    ):
        table.add_column(col, justify="right")

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    table.add_row(
        str(len(reqs)),
        str(verified),
        str(failed),
        f"{prompt_bytes / 2**30:.2f}",
        f"{gbps:.2f}",
        fmt(summary["ref_a_gbps"]),
        fmt(summary["ref_b_gbps"]),
        fmt(summary["c_over_a"]),
        fmt(summary["c_over_b"]),
        f"{pst['descriptors']} / {pst['blocks']}",
        f"{summary['ready_after_prefill_ms']['p50']:.1f} / {summary['ready_after_prefill_ms']['p99']:.1f}",
    )
    wide = Console(width=180)  # the table and the spans below, unwrapped
    wide.print(table)
    tl = summary["timeline_p50_us"]
    # with several requests in flight a WRITE's spans include waiting behind the wave's earlier posts
    # (on UCX loopback each post runs its copy on the push thread); --window 1 times one at a time
    if args.window > 1:
        wide.print(
            f"per-request spans below: window {args.window}, so they include waiting behind other WRITEs"
        )
    wide.print(
        "per-request p50 (us): trigger -> plan {trigger_to_plan_built}, -> made {trigger_to_made}, "
        "-> posted {trigger_to_posted}, posted -> complete {posted_to_complete}, complete -> decode "
        "ready {complete_to_decode_ready}".format(**tl)
    )
    bad = [r for r in reqs if not (r.ok and r.wrong == 0)]
    for r in bad[:5]:
        console.print(f"[red]{r.rid}: ok={r.ok} wrong_bytes={r.wrong} {r.reason}")
    emit_json(args, summary)
    return 0 if not bad else 1


if __name__ == "__main__":
    from kvpush.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
