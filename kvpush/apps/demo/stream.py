"""`kvpush demo --stream`: a synthetic layer-by-layer prefill, streamed against one-piece, in one run.

Per request size, requests alternate between the two modes on the same two processes and the same block
pools: the prefill process computes each layer (a sleep of --layer-compute-us-per-token x tokens: on a GPU
the host is free while the kernels run), writes that layer's pattern, and, streamed, reports the layer
ready with `PrefillEndpoint.kv_ready`; one-piece waits for `prefill_done` after the last layer. The decode
registers first (as a router-driven decode does), and every byte is verified after each request. Reported
per size and mode (p50, ms): the prefill itself, "prefill end -> decode ready" (the tail streaming
shrinks) and the TTFT-equivalent "prefill start -> decode ready".

On loopback a WRITE's copy runs on the prefill host's cores (inside NIXL's post), so the streamed copy
competes with the synthetic prefill only for the CPU the sleep leaves free; on a GPU it would not.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpush.apps.cliutil import emit_json
from kvpush.apps.demo.procs import Geometry, decode_main, prefill_main
from kvpush.apps.ports import free_port_range
from kvpush.protocol.layout import blocks_for

MODES = ("one-piece", "streamed")


@dataclass
class _Run:
    size: int
    mode: str
    start: float = 0.0  # prefill start (monotonic, the prefill process)
    end: float = 0.0  # the last layer written
    ready: float = 0.0  # decode ready (the decode process; one host, one monotonic clock)
    ok: bool = False
    wrong: int = -1
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)


def sizes(text: str) -> list[int]:
    got = [int(x) for x in text.split(",") if x.strip()]
    if not got or min(got) < 1:
        raise argparse.ArgumentTypeError(f"request sizes must be positive token counts, got {text!r}")
    return got


def configure(p: argparse.ArgumentParser) -> None:
    """The --stream flags (the geometry flags are the demo's own)."""
    p.add_argument(
        "--stream",
        action="store_true",
        help="layer-by-layer prefill, streamed (kv_ready per layer) vs one-piece, per request size",
    )
    p.add_argument(
        "--stream-sizes", type=sizes, default=[256, 1024, 4096, 8192], help="prompt tokens, comma list"
    )
    p.add_argument("--stream-requests", type=int, default=6, help="requests per size and mode")
    p.add_argument(
        "--layer-compute-us-per-token",
        type=float,
        default=0.15,
        help="synthetic compute per layer, microseconds per prompt token (0.15: ~1.2 ms a layer at 8k)",
    )


class _Side:
    """The parent's end of one child's pipe: send a command, wait for a reply of one kind."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.backlog: list[Any] = []

    def ask(self, kind: str, timeout: float = 120.0) -> Any:
        for i, msg in enumerate(self.backlog):
            if msg[0] == kind:
                return self.backlog.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.conn.poll(0.05):
                msg = self.conn.recv()
                if msg[0] == kind:
                    return msg
                self.backlog.append(msg)
        raise TimeoutError(f"no {kind!r} reply within {timeout}s")


def run_stream(args: argparse.Namespace, extra: dict[str, Any]) -> int:
    console = Console(stderr=True)
    biggest = max(args.stream_sizes)
    common = dict(
        layers=args.layers,
        total_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype_size=args.dtype_size,
        token_order=args.token_order,
        block_major=args.layout == "block-major",
    )
    p_geo = Geometry(
        block_size=args.prefill_block_size,
        num_blocks=2 * blocks_for(biggest, args.prefill_block_size) + 64,
        tp_size=args.prefill_tp,
        **common,
    )
    d_geo = Geometry(
        block_size=args.decode_block_size,
        num_blocks=2 * blocks_for(biggest, args.decode_block_size) + 64,
        tp_size=args.decode_tp,
        **common,
    )
    port = args.port or free_port_range(args.prefill_tp)
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    procs = [
        ctx.Process(
            target=prefill_main,
            args=(p_child, p_geo, port, args.seed, args.run_blocks, args.device, extra),
            name="kvpush-demo-prefill",
        ),
        ctx.Process(
            target=decode_main,
            args=(d_child, d_geo, args.seed, args.run_blocks, args.prefill_tp, args.device),
            name="kvpush-demo-decode",
        ),
    ]
    for proc in procs:
        proc.start()
    p, d = _Side(p_conn), _Side(d_conn)
    runs: list[_Run] = []
    streams = False
    try:
        address = tuple(p.ask("up")[1])
        d.ask("up")
        d_conn.send(("connect", address))
        d.ask("connected")
        p_conn.send(("caps",))
        streams = bool(p.ask("caps")[1])
        if not streams:
            console.print("[yellow]this build's PrefillEndpoint has no kv_ready: the one-piece side only")
        modes = MODES if streams else MODES[:1]
        for i, mode in enumerate(modes):  # warm-up, untimed: the pair's first WRITE prepares its lists
            _one(
                p, d, p_conn, d_conn, address, _Run(min(args.stream_sizes), mode), f"warm-{i}", 1000 + i, 0.0
            )
        tag = 0
        for size in args.stream_sizes:
            for i in range(args.stream_requests * len(modes)):
                tag += 1
                run = _Run(size, modes[i % len(modes)])
                _one(p, d, p_conn, d_conn, address, run, f"s{size}-{i}", tag, args.layer_compute_us_per_token)
                runs.append(run)
        p_conn.send(("stats",))
        d_conn.send(("stats",))
        p_stats, d_stats = p.ask("stats"), d.ask("stats")
    finally:
        for conn in (p_conn, d_conn):
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
    return _report(args, runs, streams, p_stats, d_stats, console)


def _one(
    p: _Side, d: _Side, p_conn: Any, d_conn: Any, address: Any, run: _Run, rid: str, tag: int, us_tok: float
) -> None:
    """One request: the decode registers, the prefill computes layer by layer, then verify and free."""
    d_conn.send(("expect", rid, run.size, tag, address))
    d.ask("expected")
    time.sleep(0.002)  # the registration reaches the prefill before its first layer is ready
    p_conn.send(("prefill_layers", rid, run.size, tag, us_tok * 1e-6 * run.size, run.mode == "streamed"))
    _, _, run.start, run.end, _blocks = p.ask("prefilled_layers")
    _, _, ok, reason, run.ready, _nbytes = d.ask("ready")
    released = p.ask("released")
    run.ok = bool(ok and released[2])
    run.reason = reason or released[3]
    run.timings = released[4]
    d_conn.send(("verify", rid))
    run.wrong = d.ask("verified")[2]


def _ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3) if values else 0.0


def summarize(runs: list[_Run]) -> list[dict[str, Any]]:
    """Per size and mode: counts and p50s in ms; streamed rows carry their tail over one-piece's."""
    rows: list[dict[str, Any]] = []
    for size in sorted({r.size for r in runs}):
        by_mode: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            rs = [r for r in runs if r.size == size and r.mode == mode]
            if not rs:
                continue
            good = [r for r in rs if r.ok and r.wrong == 0]
            by_mode[mode] = {
                "tokens": size,
                "mode": mode,
                "requests": len(rs),
                "verified": len(good),
                "prefill_ms": _ms([r.end - r.start for r in good]),
                "prefill_end_to_ready_ms": _ms([r.ready - r.end for r in good]),
                "ttft_equivalent_ms": _ms([r.ready - r.start for r in good]),
            }
        one, streamed = by_mode.get("one-piece"), by_mode.get("streamed")
        if one and streamed:
            for key in ("prefill_end_to_ready_ms", "ttft_equivalent_ms"):
                base = one[key]
                streamed[key.replace("_ms", "_vs_one_piece")] = (
                    round(streamed[key] / base, 3) if base else None
                )
        rows.extend(by_mode.values())
    return rows


def _report(
    args: argparse.Namespace, runs: list[_Run], streams: bool, p_stats: Any, d_stats: Any, console: Console
) -> int:
    rows = summarize(runs)
    table = Table(title=f"kvpush demo --stream: layer-by-layer prefill, {args.layers} layers, UCX loopback")
    cols = ("tokens", "mode", "verified", "prefill p50 ms", "prefill end -> ready p50 ms", "TTFT-eq p50 ms")
    for col in (*cols, "tail vs one-piece"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["tokens"]),
            row["mode"],
            f"{row['verified']}/{row['requests']}",
            f"{row['prefill_ms']:.2f}",
            f"{row['prefill_end_to_ready_ms']:.2f}",
            f"{row['ttft_equivalent_ms']:.2f}",
            "-"
            if row.get("prefill_end_to_ready_vs_one_piece") is None
            else f"{row['prefill_end_to_ready_vs_one_piece']:.2f}",
        )
    Console(width=160).print(table)
    bad = [r for r in runs if not (r.ok and r.wrong == 0)]
    for r in bad[:5]:
        console.print(f"[red]{r.size} tokens {r.mode}: ok={r.ok} wrong_bytes={r.wrong} {r.reason}")
    free_p, total_p = p_stats[2], p_stats[3]
    free_d, total_d = d_stats[2], d_stats[3]
    summary = {
        "stream": True,
        "streamed_side": streams,
        "layers": args.layers,
        "layer_compute_us_per_token": args.layer_compute_us_per_token,
        "requests": len(runs),
        "verified": len(runs) - len(bad),
        "rows": rows,
        "wire_errors": p_stats[1]["wire_errors"] + d_stats[1]["wire_errors"],
        "writes": p_stats[1]["writes"],
        "blocks_free_after": {"prefill": [free_p, total_p], "decode": [free_d, total_d]},
    }
    emit_json(args, summary)
    leaked = free_p != total_p or free_d != total_d
    if leaked:
        console.print("[red]a block was not released")
    return 0 if not bad and not leaked else 1
