"""`kvpush bench-vllm`: kvpush vs vLLM's NixlPushConnector vs NixlConnector (pull) on real vLLM.

One run drives the set-ups one after another on the same machine with the same workload and seed:
repetitions alternate the order (A B C, then C B A, ...), each repetition starts its servers afresh,
and every (QPS, input length) point is one run of vLLM's own `vllm bench serve` (random dataset:
prompts of exactly that many tokens, the same for every set-up; Poisson arrivals). Each point's JSON
`<connector>_qps<q>_in<in>_out<out>_iter<i>.json` is vLLM's own result file plus our extras
(prefill_to_first_token_s from the proxy's GET /kvpush/timings, connector, calibration); the summary holds
median TTFT/TPOT, the ratio of medians kvpush / baseline with a bootstrap 95% interval, the idle CPU
of each set-up's process tree, and (for kvpush) the prefill-done -> decode-ready times.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvpush.apps.cliutil import alias, positive_int
from kvpush.errors import KVPushError

from .bench_measure import (
    _nixl_tune_env,
    _thread_ns,
    _vllm_xfer_metrics,
    _warm_up,
    calibrate_prefill,
    idle_cpu,
    kvpush_threads,
    points_from_loads,
    proxy_timings,
    run_point,
)
from .bench_report import _extras_md, _ok_ttfts, _plot, _summarize, _tpots, bootstrap_ratio, plot_only
from .serve_pd import start_pd
from .vllm_router import ROUTERS

# The instruments and the arithmetic live in bench_measure and bench_report; these stay reachable here,
# where the head-to-head's callers and tests have always found them.
# What one run compares, by name (the --connectors list; result files and tables use these names): vLLM's
# two NIXL connectors, and kvpush moving a request in one piece after its prefill (its default) or
# streamed, each chunked-prefill step's complete blocks pushed as the step ends (extra config stream).
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "kvpush": ("kvpush", {}),
    "kvpush-streamed": ("kvpush", {"stream": True}),
    "kvpush-layers": ("kvpush", {"stream_layers": 8}),  # also every 8 layers within a step (save_kv_layer)
    "nixl-push": ("nixl-push", {}),
    "nixl-pull": ("nixl-pull", {}),
}

__all__ = [
    "ARMS",
    "_summarize",
    "_thread_ns",
    "bootstrap_ratio",
    "check_arm",
    "configure",
    "kvpush_threads",
    "points_from_loads",
    "proxy_timings",
    "run",
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connectors",
        default="kvpush,nixl-push,nixl-pull",
        help=f"comma-separated set-ups, run side by side: {', '.join(ARMS)} (kvpush-streamed: kvpush's "
        "push per prefill chunk; give the prefill several chunks with --max-num-batched-tokens; kvpush-layers: "
        "also every 8 layers of each step as vLLM writes them)",
    )
    parser.add_argument(
        "--request-rate", dest="qps", metavar="RATES", default="1,4", help="comma-separated request rates"
    )
    alias(parser, "--qps", "qps")
    parser.add_argument(
        "--loads",
        default="",
        help="comma-separated offered prefill loads (fractions of one prefill engine's capacity, measured "
        "first with a single engine); replaces --request-rate with a per-input-length request rate",
    )
    parser.add_argument(
        "--random-input-len",
        dest="input_lens",
        metavar="LENS",
        default="1024,4096",
        help="comma-separated prompt lengths (tokens)",
    )
    alias(parser, "--input-lens", "input_lens")
    parser.add_argument("--random-output-len", dest="output_len", metavar="N", type=positive_int, default=32)
    alias(parser, "--output-len", "output_len", type=positive_int)
    parser.add_argument("--num-prompts", type=positive_int, default=40)
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--variant", default="realistic")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--result-dir", default="out/bench-vllm")
    parser.add_argument(
        "--nixl-prog-delay-us",
        type=int,
        default=100,
        help="progress-thread delay for vLLM's own NIXL agents (0 = NIXL's default spin)",
    )
    parser.add_argument(
        "--nixl-tune-connectors",
        default="nixl-pull,nixl-push",
        help="vLLM connectors that get --nixl-prog-delay-us (the rest keep NIXL's spinning progress thread)",
    )
    parser.add_argument(
        "--keep-kv-core-pin",
        action="store_true",
        help="leave vLLM's NIXL worker core pin in place (by default it is neutralised so each engine keeps "
        "its own core, see docs/vllm.md)",
    )
    parser.add_argument(
        "--no-confine",
        action="store_true",
        help="do not confine each engine's processes to its own core (by default prefill's API server, "
        "EngineCore and worker run on core 0 and decode's on core 1, like two hosts; see docs/vllm.md)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="VLLM_CPU_KVCACHE_SPACE for every engine (push reserves decode blocks for the whole prefill)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="vLLM's token budget per engine step, for the prefill engine (and the single engine of "
        "--loads' calibration): a prompt longer than it is prefilled in several chunks (chunked prefill); "
        "default: vLLM's own",
    )
    parser.add_argument("--request-timeout", type=float, default=180.0, help="per-request client timeout (s)")
    parser.add_argument("--warmup-tries", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="only redraw the figures from --result-dir")
    parser.add_argument("--warmup-timeout", type=float, default=60.0)
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default="kvpush",
        help="what the load goes through: kvpush's proxy (the benchmark's instrument: it records prefill "
        "answered -> first token) or vLLM's vllm-router (no such timings)",
    )


def run(args: argparse.Namespace) -> int:
    from .tiny_model import build

    if args.plot_only:
        plot_only(Path(args.result_dir))
        return 0
    model = args.model or str(build(args.variant))
    conns = [c.strip() for c in args.connectors.split(",") if c.strip()]
    for c in conns:
        check_arm(c)
    in_lens = [int(x) for x in args.input_lens.split(",")]
    engine_args = _engine_args(args)
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    calibration: dict[int, float] = {}
    if args.loads:
        loads = [float(x) for x in args.loads.split(",")]
        calibration = calibrate_prefill(
            model,
            in_lens,
            out_dir / "logs" / "calibrate",
            args.seed,
            confine=not args.no_confine,
            kv_cache_gib=args.kv_cache_gib,
            engine_args=engine_args,
        )
        points = points_from_loads(calibration, loads)
        print("prefill alone: " + ", ".join(f"{n} tokens {1000 * t:.0f} ms" for n, t in calibration.items()))
    else:
        points = [(n, float(q)) for n in in_lens for q in args.qps.split(",")]
    print("points (input tokens, QPS): " + ", ".join(f"({n}, {q:g})" for n, q in points), flush=True)
    samples: dict[tuple[str, float, int], dict[str, list[float]]] = {}
    idle: dict[str, list[float]] = {}
    idle_threads: dict[str, list[float]] = {}
    ready: dict[str, list[float]] = {}
    tune_conns = {c.strip() for c in args.nixl_tune_connectors.split(",") if c.strip()}
    texts: dict[tuple[str, float, int], list[list[str | None]]] = {}
    warmups: dict[str, list[dict[str, Any]]] = {}
    push: dict[str, list[float]] = {}
    xfer: dict[str, list[tuple[int, float]]] = {}
    for rep in range(args.reps):
        order = conns if rep % 2 == 0 else list(reversed(conns))
        for conn in order:
            connector, arm_extra = ARMS[conn]
            ours = connector == "kvpush"
            stats_dir = out_dir / f"stats-{conn}-{rep}"
            extra = {"stats_dir": str(stats_dir), **arm_extra} if ours else dict(arm_extra)
            env = (
                {}
                if ours
                else _nixl_tune_env(
                    args.nixl_prog_delay_us if conn in tune_conns else 0, unpin=not args.keep_kv_core_pin
                )
            )
            if not ours:
                env["VLLM_LOGGING_LEVEL"] = "INFO"  # its periodic "KV Transfer metrics" lines
            print(f"[rep {rep}] starting {conn}", flush=True)
            log_dir = out_dir / "logs" / f"{conn}-{rep}"
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
            dep = start_pd(
                connector,
                model,
                log_dir,
                prefill_extra=extra,
                decode_extra=extra,
                prefill_env=env,
                decode_env=env,
                confine_engines=not args.no_confine,
                router=args.router,
                prefill_args=engine_args,
            )
            try:
                warm = _warm_up(dep.url, model, args.warmup_tries, args.warmup_timeout)
                warmups.setdefault(conn, []).append(warm)
                print(f"  warm-up: {warm}", flush=True)
                if not warm["ok"]:
                    print(f"  {conn} never answered a warm-up request; skipping its points", flush=True)
                    continue
                tree, per_thread = idle_cpu(
                    dep, args.idle_seconds, kvpush_threads(stats_dir) if ours else None
                )
                idle.setdefault(conn, []).append(tree)
                for k, v in per_thread.items():
                    idle_threads.setdefault(k if conn == "kvpush" else f"{conn}/{k}", []).append(v)
                for n, q in points:
                    name = f"{conn}_qps{q:g}_in{n}_out{args.output_len}_iter{rep}.json"
                    res = run_point(
                        dep.url,
                        model,
                        n,
                        q,
                        args.output_len,
                        args.num_prompts,
                        args.seed + rep,
                        out_dir,
                        name,
                        args.request_timeout,
                        dep.timings_token,
                    )
                    res["connector"] = conn
                    if n in calibration:
                        res["prefill_alone_s"] = calibration[n]
                        res["offered_prefill_load"] = q * calibration[n]
                    (out_dir / name).write_text(json.dumps(res))
                    texts.setdefault((conn, q, n), []).append(res["generated_texts"])
                    s = samples.setdefault((conn, q, n), {"ttft": [], "tpot": [], "p2d": []})
                    s["ttft"] += _ok_ttfts(res)
                    s["tpot"] += _tpots(res)
                    s["p2d"] += res["prefill_to_first_token_s"]
                    print(
                        f"  {name}: median TTFT {res['median_ttft_ms']:.1f} ms, TPOT "
                        f"{res['median_tpot_ms']:.1f} ms, failed {res['failed']}",
                        flush=True,
                    )
                if ours:
                    for f in stats_dir.glob("*decode*.json"):
                        ready.setdefault(conn, []).extend(json.loads(f.read_text()).get("ready_s", []))
                    for f in stats_dir.glob("*prefill*.json"):
                        push.setdefault(conn, []).extend(json.loads(f.read_text()).get("push_s", []))
            finally:
                dep.stop()
            if not ours:
                xfer.setdefault(conn, []).extend(_vllm_xfer_metrics(log_dir))
    summary = _summarize(conns, points, samples, idle, ready, calibration)
    summary["kvpush_idle_thread_cores"] = idle_threads
    if idle_threads:
        summary["table_md"] += (
            "kvpush's own threads while idle (share of one core, per repetition): "
            + "; ".join(
                f"{k} " + ", ".join(f"{100 * x:.2f}%" for x in v) for k, v in sorted(idle_threads.items())
            )
            + "\n"
        )
    summary["extra_md"] = _extras_md(conns, points, samples, texts, warmups, push, xfer, idle)
    summary["table_md"] += summary["extra_md"]
    summary["warmups"] = warmups
    summary["kvpush_push_s"] = push.get("kvpush", [])
    summary["push_s"] = push
    summary["vllm_xfer_ms"] = {c: v for c, v in xfer.items()}
    summary["args"] = vars(args)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "summary.md").write_text(summary["table_md"])
    print(summary["table_md"])
    summary["calibration_prefill_s"] = {str(n): t for n, t in calibration.items()}
    _plot(out_dir, conns, points, samples)
    return 0


def _engine_args(args: argparse.Namespace) -> list[str]:
    """vLLM flags for the prefill engine (and the single engine that calibrates --loads)."""
    if args.max_num_batched_tokens is None:
        return []
    # vLLM refuses a step budget below the longest sequence unless chunked prefill is on (the default
    # on V1; said explicitly so a version that differs fails loudly rather than serving unchunked)
    return ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enable-chunked-prefill"]


def check_arm(name: str) -> None:
    """SystemExit naming the problem, before any engine starts, if `name` is no arm or its kvpush extra
    config is one this connector refuses (e.g. streaming on a kvpush without vLLM progressive push)."""
    if name not in ARMS:
        raise SystemExit(f"unknown connector {name!r}; choose from {', '.join(ARMS)}")
    connector, extra = ARMS[name]
    if connector != "kvpush":
        return
    from ..params import ConnectorSettings

    try:
        ConnectorSettings.from_extra("prefill", name, extra, block_size=16, tp_size=1, pp_size=1)
    except KVPushError as exc:
        raise SystemExit(f"{name}: this kvpush refuses its extra config {extra}: {exc}") from None
