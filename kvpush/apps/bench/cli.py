"""`kvpush bench`: push vs pull on the engine emulator, one run, modes interleaved point by point."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from kvpush.apps.bench.steps import MODES, PUSH
from kvpush.apps.cliutil import alias, non_negative_int, port, positive_int

QUICK = {
    "qps": "1,8",
    "input_lens": "1000,16000",
    "output_len": 64,
    "duration": 2.0,
    "min_requests": 4,
    "max_requests": 16,
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="push,pull,pull-threaded", help="comma list of " + ",".join(MODES))
    parser.add_argument(
        "--request-rate",
        dest="qps",
        metavar="RATES",
        default="1,2,4,8",
        help="comma list of request rates (Poisson arrivals)",
    )
    alias(parser, "--qps", "qps")
    parser.add_argument(
        "--random-input-len",
        dest="input_lens",
        metavar="LENS",
        default="1000,4000,8000,16000",
        help="comma list of prompt lengths",
    )
    alias(parser, "--input-lens", "input_lens")
    parser.add_argument("--random-output-len", dest="output_len", metavar="N", type=positive_int, default=128)
    alias(parser, "--output-len", "output_len", type=positive_int)
    parser.add_argument(
        "--duration",
        type=float,
        default=8.0,
        help="seconds of arrivals per point (requests = qps * duration, clamped)",
    )
    parser.add_argument(
        "--num-prompts",
        dest="num_requests",
        metavar="N",
        type=non_negative_int,
        default=0,
        help="fixed request count per point",
    )
    alias(parser, "--num-requests", "num_requests", type=non_negative_int)
    parser.add_argument("--min-requests", type=positive_int, default=8)
    parser.add_argument("--max-requests", type=positive_int, default=64)
    parser.add_argument(
        "--num-warmups",
        dest="warmup",
        metavar="N",
        type=non_negative_int,
        default=3,
        help="warm-up requests per mode (not recorded)",
    )
    alias(parser, "--warmup", "warmup", type=non_negative_int)
    parser.add_argument("--iterations", type=positive_int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model", default=None, help="TOML cost model (default: Qwen3-32B TP8 H200)")
    parser.add_argument(
        "--pull-descriptor-merge",
        choices=("in-order", "sorted"),
        default=None,
        help="override the cost model's pull descriptor count model",
    )
    parser.add_argument(
        "--pool-aging-wraps",
        type=float,
        default=None,
        help="override the cost model's pool aging (0: fresh pools; 1: one wrap, block "
        "tables descending; 2: default, ascending)",
    )
    parser.add_argument("--base-port", type=port, default=25600)
    parser.add_argument("--result-dir", dest="out", metavar="DIR", default="results", help="results folder")
    alias(parser, "--out", "out")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="qps 1,8 x input 1000,16000, output 64, few requests: < 3 minutes",
    )
    parser.add_argument("--no-progress", action="store_true")


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in str(s).split(",") if x]


def _qtag(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def result_name(mode: str, qps: float, in_len: int, out_len: int, it: int) -> str:
    return f"{mode}_qps{_qtag(qps)}_in{in_len}_out{out_len}_iter{it}.json"


def run(args: argparse.Namespace) -> int:  # noqa: C901
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpush.apps.bench.costmodel import CostModel
    from kvpush.apps.bench.metrics import summarize
    from kvpush.apps.bench.runner import EnginePair, breakdown

    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    qps_list, in_lens = _floats(args.qps), _ints(args.input_lens)
    spec: dict[str, Any] = {"path": args.cost_model, "overrides": {}}
    if args.pull_descriptor_merge:
        spec["overrides"]["pull"] = {"descriptor_merge": args.pull_descriptor_merge}
    spec["overrides"]["emulation"] = {"age_input_lens": in_lens, "age_output_len": args.output_len}
    if args.pool_aging_wraps is not None:
        spec["overrides"]["emulation"]["pool_aging_wraps"] = args.pool_aging_wraps
    cm = CostModel.from_spec(spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True, quiet=args.no_progress)
    ctx = mp.get_context("spawn")
    pairs: dict[str, EnginePair] = {}
    summary: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()},
        "cost_model": cm.describe(),
        "points": [],
        "breakdown": {},
    }
    t_start = time.monotonic()
    try:
        console.log(f"starting {', '.join(modes)} engines")
        for i, m in enumerate(modes):  # all modes' engines start side by side (spawn + pools + NIXL)
            pairs[m] = EnginePair(m, args.base_port + 10 * i, spec)
            pairs[m].start_prefill(ctx)
        for p in pairs.values():
            p.wait_prefill()
            p.start_decode(ctx, wait=False)
        for p in pairs.values():
            p.wait_decode()
        for p in pairs.values():
            if args.warmup:
                p.run_point(4.0, min(in_lens), 8, args.warmup, seed=10_000 + args.seed, tag="warmup")
        summary["transport_impl"] = "kvpush.transport.nixl.NixlTransport"
        points = [(it, q, n) for it in range(args.iterations) for n in in_lens for q in qps_list]
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            disable=args.no_progress,
        ) as progress:
            task = progress.add_task("sweep", total=len(points) * len(modes))
            for it, q, n_in in points:
                if args.num_requests:
                    n_req = args.num_requests
                else:
                    n_req = max(args.min_requests, min(args.max_requests, round(q * args.duration)))
                seed = args.seed * 1_000_003 + it * 7919 + int(q * 100) * 31 + n_in  # same for every mode
                row: dict[str, Any] = {
                    "qps": q,
                    "input_len": n_in,
                    "output_len": args.output_len,
                    "iteration": it,
                    "num_requests": n_req,
                }
                for m in modes:  # modes interleaved point by point: machine noise hits all alike
                    progress.update(task, description=f"{m:>13} qps={_qtag(q)} in={n_in}")
                    cpu0 = pairs[m].cpu_s()
                    recs, dur = pairs[m].run_point(
                        q, n_in, args.output_len, n_req, seed, tag=f"{it}-{q}-{n_in}"
                    )
                    res = summarize(recs, dur, n_in)
                    res["engine_cpu_s"] = {k: round(v - cpu0[k], 3) for k, v in pairs[m].cpu_s().items()}
                    res["load_avg"] = os.getloadavg()
                    res.update(
                        {
                            "backend": f"kvpush-bench-{m}",
                            "mode": m,
                            "model_id": f"{cm.raw['model'].get('name', '?')} (emulated)",
                            "model_tp": cm.raw["model"].get("tp_size"),
                            "request_rate": q,
                            "burstiness": 1.0,
                            "max_concurrency": None,
                            "num_prompts": n_req,
                            "input_len": n_in,
                            "output_len": args.output_len,
                            "iteration": it,
                            "breakdown_ms": breakdown(recs),
                        }
                    )
                    (out / result_name(m, q, n_in, args.output_len, it)).write_text(json.dumps(res, indent=1))
                    row[m] = {
                        k: res[k]
                        for k in (
                            "completed",
                            "failed",
                            "median_ttft_ms",
                            "median_tpot_ms",
                            "mean_ttft_ms",
                            "mean_tpot_ms",
                            "p99_ttft_ms",
                        )
                    }
                    row[m]["breakdown_ms"] = res["breakdown_ms"]
                    progress.advance(task)
                if PUSH in row:
                    for m in modes:
                        if m != PUSH and m in row:
                            for metric in ("ttft", "tpot"):
                                den = row[PUSH][f"median_{metric}_ms"]
                                row[f"{m}/push_median_{metric}"] = (
                                    row[m][f"median_{metric}_ms"] / den if den else None
                                )
                summary["points"].append(row)
                (out / "summary.json").write_text(json.dumps(summary, indent=1))
    finally:
        for p in pairs.values():
            p.stop(join=False)
        for p in pairs.values():
            p.join()
    summary["wall_s"] = time.monotonic() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(markdown_table(summary, modes))
    _print_table(console, summary, modes)
    return 0


def markdown_table(summary: dict[str, Any], modes: list[str]) -> str:
    """The measured table as Markdown (median TTFT/TPOT ms and pull/push ratios)."""
    ratio_modes = [m for m in modes if m != PUSH] if PUSH in modes else []
    head = ["in", "QPS"] + [f"{m} TTFT / TPOT" for m in modes] + [f"{m}/push TTFT, TPOT" for m in ratio_modes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["points"]:
        cells = [str(row["input_len"]), _qtag(row["qps"])]
        cells += [f"{row[m]['median_ttft_ms']:.0f} / {row[m]['median_tpot_ms']:.2f}" for m in modes]
        cells += [
            f"{row[f'{m}/push_median_ttft'] or 0:.2f}, {row[f'{m}/push_median_tpot'] or 0:.2f}"
            for m in ratio_modes
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _print_table(console: Any, summary: dict[str, Any], modes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="median TTFT / TPOT (ms); pull/push ratios")
    t.add_column("in")
    t.add_column("qps")
    for m in modes:
        t.add_column(f"{m} TTFT")
        t.add_column(f"{m} TPOT")
    ratio_modes = [m for m in modes if m != PUSH] if PUSH in modes else []
    for m in ratio_modes:
        t.add_column(f"{m}/push TTFT")
        t.add_column(f"{m}/push TPOT")
    for row in summary["points"]:
        cells = [str(row["input_len"]), _qtag(row["qps"])]
        for m in modes:
            cells += [f"{row[m]['median_ttft_ms']:.1f}", f"{row[m]['median_tpot_ms']:.2f}"]
        for m in ratio_modes:
            cells += [f"{row[f'{m}/push_median_ttft'] or 0:.2f}", f"{row[f'{m}/push_median_tpot'] or 0:.2f}"]
        t.add_row(*cells)
    Console(width=240).print(t)
