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
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from kvpush.apps.cliutil import alias, positive_int
from kvpush.apps.procstat import thread_run_ns

from . import client
from .serve_pd import CONNECTORS, Deployment, start_pd
from .vllm_bench import bench_serve_argv, run_bench_serve
from .vllm_router import ROUTERS

CLK = os.sysconf("SC_CLK_TCK")


def _tree_pids(dep: Deployment) -> list[int]:
    groups = {p.pid for p in dep.procs if "proxy" not in p.name}
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.getpgid(int(d)) in groups:
                out.append(int(d))
        except (ProcessLookupError, PermissionError):
            continue
    return out


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / CLK


def _thread_ns(pid: int, tid: int) -> int | None:
    return thread_run_ns(pid, tid)


def kvpush_threads(stats_dir: Path) -> dict[str, tuple[int, int]]:
    """kvpush's own threads in the engines, as the connector reports them: label -> (pid, tid)."""
    out: dict[str, tuple[int, int]] = {}
    for f in sorted(stats_dir.glob("*.json")):
        try:
            snap = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for name, tid in (snap.get("threads") or {}).items():
            out[f"{snap.get('role', f.stem)}:{name}"] = (int(snap["pid"]), int(tid))
    return out


def idle_cpu(
    dep: Deployment, seconds: float = 5.0, threads: dict[str, tuple[int, int]] | None = None
) -> tuple[float, dict[str, float]]:
    """Cores the set-up's engine processes burn while no request is in flight, and, per named thread,
    the cores that thread burns (schedstat: exact run time, not tick samples)."""
    pids = _tree_pids(dep)
    threads = threads or {}
    t0 = time.monotonic()
    a = _cpu_seconds(pids)
    ta = {k: _thread_ns(*v) for k, v in threads.items()}
    time.sleep(seconds)
    tb = {k: _thread_ns(*v) for k, v in threads.items()}
    wall = time.monotonic() - t0
    per_thread: dict[str, float] = {}
    for k in threads:
        before, after = ta[k], tb[k]
        if before is not None and after is not None:
            per_thread[k] = (after - before) / 1e9 / wall
    return (_cpu_seconds(pids) - a) / wall, per_thread


def proxy_timings(url: str, token: str, clear: bool = True) -> list[dict[str, Any]]:
    """The proxy's per-request timestamps (see proxy_http.TimingsLog; the proxy serves them only with
    its token, Deployment.timings_token); [] if the proxy has none."""
    import urllib.request

    req = urllib.request.Request(
        f"{url}/kvpush/timings{'?clear=1' if clear else ''}", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def prefill_to_first_token(timings: list[dict[str, Any]]) -> list[float]:
    """Seconds from the prefill's answer reaching the proxy to decode's first chunk reaching it.

    The same instrument for every connector: transfer, decode noticing and one decode step. Negative
    when decode's first token arrives before the prefill's HTTP answer does."""
    return [
        t["first_chunk"] - t["prefill_done"] for t in timings if "first_chunk" in t and "prefill_done" in t
    ]


def run_point(
    url: str,
    model: str,
    input_len: int,
    qps: float,
    out_len: int,
    num_prompts: int,
    seed: int,
    out_dir: Path,
    name: str,
    timeout_s: float = 600.0,
    timings_token: str = "",
) -> dict[str, Any]:
    """One point driven by vLLM's own `vllm bench serve`; its result file plus our extras:
    prefill_to_first_token_s (the proxy's clock, same instrument for every connector)."""
    proxy_timings(url, timings_token)  # drop the warm-up's and earlier points' records
    result = out_dir / name
    argv = bench_serve_argv(
        url,
        model,
        input_len=input_len,
        output_len=out_len,
        num_prompts=num_prompts,
        request_rate=qps,
        seed=seed,
        result_dir=out_dir,
        result_filename=name,
        request_id_prefix=f"b{seed}-{time.time_ns()}-",
    )
    # the whole point may take num_prompts x the per-request timeout at worst; bound it anyway
    out = run_bench_serve(argv, result, max(600.0, timeout_s * 4), out_dir / "logs" / f"{name}.log")
    out["prefill_to_first_token_s"] = prefill_to_first_token(proxy_timings(url, timings_token))
    out["load_generator"] = " ".join(argv[: argv.index("--backend")])
    return out


def bootstrap_ratio(
    a: list[float], b: list[float], n: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """median(a)/median(b) and its bootstrap 95% interval."""
    if not a or not b:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    point = statistics.median(a) / statistics.median(b)
    rs = []
    for _ in range(n):
        ra = statistics.median(rng.choices(a, k=len(a)))
        rb = statistics.median(rng.choices(b, k=len(b)))
        rs.append(ra / rb)
    rs.sort()
    return point, rs[int(0.025 * n)], rs[int(0.975 * n) - 1]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connectors", default="kvpush,nixl-push,nixl-pull")
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


def _words_for_tokens(n: int) -> int:
    return max(1, n // 2)  # the tiny tokenizer gives about 2 tokens per corpus word


def run(args: argparse.Namespace) -> int:
    from .tiny_model import build

    if args.plot_only:
        plot_only(Path(args.result_dir))
        return 0
    model = args.model or str(build(args.variant))
    conns = [c.strip() for c in args.connectors.split(",") if c.strip()]
    for c in conns:
        if c not in CONNECTORS:
            raise SystemExit(f"unknown connector {c!r}; choose from {', '.join(CONNECTORS)}")
    in_lens = [int(x) for x in args.input_lens.split(",")]
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
            stats_dir = out_dir / f"stats-{conn}-{rep}"
            extra = {"stats_dir": str(stats_dir)} if conn == "kvpush" else {}
            env = (
                {}
                if conn == "kvpush"
                else _nixl_tune_env(
                    args.nixl_prog_delay_us if conn in tune_conns else 0, unpin=not args.keep_kv_core_pin
                )
            )
            if conn != "kvpush":
                env["VLLM_LOGGING_LEVEL"] = "INFO"  # its periodic "KV Transfer metrics" lines
            print(f"[rep {rep}] starting {conn}", flush=True)
            log_dir = out_dir / "logs" / f"{conn}-{rep}"
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
            dep = start_pd(
                conn,
                model,
                log_dir,
                prefill_extra=extra,
                decode_extra=extra,
                prefill_env=env,
                decode_env=env,
                confine_engines=not args.no_confine,
                router=args.router,
            )
            try:
                warm = _warm_up(dep.url, model, args.warmup_tries, args.warmup_timeout)
                warmups.setdefault(conn, []).append(warm)
                print(f"  warm-up: {warm}", flush=True)
                if not warm["ok"]:
                    print(f"  {conn} never answered a warm-up request; skipping its points", flush=True)
                    continue
                tree, per_thread = idle_cpu(
                    dep, args.idle_seconds, kvpush_threads(stats_dir) if conn == "kvpush" else None
                )
                idle.setdefault(conn, []).append(tree)
                for k, v in per_thread.items():
                    idle_threads.setdefault(k, []).append(v)
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
                if conn == "kvpush":
                    for f in stats_dir.glob("*decode*.json"):
                        ready.setdefault(conn, []).extend(json.loads(f.read_text()).get("ready_s", []))
                    for f in stats_dir.glob("*prefill*.json"):
                        push.setdefault(conn, []).extend(json.loads(f.read_text()).get("push_s", []))
            finally:
                dep.stop()
            if conn != "kvpush":
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
    summary["vllm_xfer_ms"] = {c: v for c, v in xfer.items()}
    summary["args"] = vars(args)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "summary.md").write_text(summary["table_md"])
    print(summary["table_md"])
    summary["calibration_prefill_s"] = {str(n): t for n, t in calibration.items()}
    _plot(out_dir, conns, points, samples)
    return 0


def _warm_up(url: str, model: str, tries: int, timeout_s: float) -> dict[str, Any]:
    """A first request through the proxy; retried, because a first NIXL handshake can time out."""
    out: dict[str, Any] = {"ok": False, "attempts": []}
    for _ in range(max(1, tries)):
        r = client.stream_complete(url, model, "warm up", 4, timeout=timeout_s)
        out["attempts"].append({"ok": r.ok, "latency_s": round(r.latency, 3), "error": r.error})
        if r.ok:
            out["ok"] = True
            break
    return out


def _vllm_xfer_metrics(log_dir: Path) -> list[tuple[int, float]]:
    """(count, avg xfer ms) from vLLM's periodic 'KV Transfer metrics' log lines (both engines)."""
    import re

    pat = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([0-9.]+)")
    out: list[tuple[int, float]] = []
    for f in sorted(log_dir.glob("*.log")):
        for m in pat.finditer(f.read_text(errors="replace")):
            if int(m.group(1)) > 0:
                out.append((int(m.group(1)), float(m.group(2))))
    return out


def _extras_md(
    conns: list[str],
    points: list[tuple[int, float]],
    samples: dict[tuple[str, float, int], dict[str, list[float]]],
    texts: dict[tuple[str, float, int], list[list[str | None]]],
    warmups: dict[str, list[dict[str, Any]]],
    push: dict[str, list[float]],
    xfer: dict[str, list[tuple[int, float]]],
    idle: dict[str, list[float]],
) -> str:
    lines = [
        "",
        "| input | QPS | "
        + " | ".join(f"{c} TPOT p50 ms" for c in conns)
        + " | "
        + " | ".join(f"kvpush/{c} TPOT [95% CI]" for c in conns if c != "kvpush")
        + " | outputs identical to kvpush |",
    ]
    lines.append("|" + "---|" * (3 + len(conns) + len([c for c in conns if c != "kvpush"])))
    for n, q in points:
        cells = []
        for c in conns:
            tp = samples.get((c, q, n), {}).get("tpot", [])
            cells.append(f"{1000 * statistics.median(tp):.1f}" if tp else "n/a")
        ratios = []
        for c in conns:
            if c == "kvpush":
                continue
            r, lo, hi = bootstrap_ratio(
                samples.get(("kvpush", q, n), {}).get("tpot", []),
                samples.get((c, q, n), {}).get("tpot", []),
            )
            ratios.append(f"{r:.2f} [{lo:.2f}, {hi:.2f}]")
        same = []
        ref = texts.get(("kvpush", q, n), [])
        for c in conns:
            if c == "kvpush":
                continue
            eq = tot = 0
            for a_rep, b_rep in zip(ref, texts.get((c, q, n), []), strict=False):
                for a, b in zip(a_rep, b_rep, strict=False):
                    if a is not None and b is not None:
                        tot += 1
                        eq += a == b
            same.append(f"{c} {eq}/{tot}")
        lines.append(
            f"| {n} | {q:g} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(ratios)
            + " | "
            + ", ".join(same)
            + " |"
        )
    lines += [
        "",
        "Prefill answered -> decode's first token, at the proxy (same instrument for every connector; "
        "median, p90 in ms):",
        "",
        "| input | QPS | " + " | ".join(conns) + " |",
        "|" + "---|" * (2 + len(conns)),
    ]
    for n, q in points:
        cells = []
        for c in conns:
            v = sorted(samples.get((c, q, n), {}).get("p2d", []))
            cells.append(
                f"{1000 * statistics.median(v):.1f} ({1000 * v[int(0.9 * (len(v) - 1))]:.1f})" if v else "n/a"
            )
        lines.append(f"| {n} | {q:g} | " + " | ".join(cells) + " |")
    lines.append("")
    for c, ws in warmups.items():
        lines.append(
            f"Warm-up {c}: "
            + "; ".join(
                f"{'ok' if w['ok'] else 'FAILED'} after {len(w['attempts'])} attempt(s) "
                f"({', '.join(str(a['latency_s']) + ' s' for a in w['attempts'])})"
                for w in ws
            )
        )
    if push.get("kvpush"):
        p = sorted(push["kvpush"])
        lines.append(
            f"kvpush prefill-done -> WRITE complete (KV in decode memory): median "
            f"{1000 * statistics.median(p):.1f} ms, p90 {1000 * p[int(0.9 * (len(p) - 1))]:.1f} ms "
            f"over {len(p)} requests"
        )
    for c, windows in xfer.items():
        tot = sum(k for k, _ in windows)
        if tot:
            avg = sum(k * ms for k, ms in windows) / tot
            lines.append(
                f"{c}: vLLM's own 'Avg xfer time' (count-weighted over its 10 s log windows, both "
                f"engines' lines): {avg:.1f} ms over {tot} transfers"
            )
    for c, cores in idle.items():
        lines.append(f"Idle CPU {c}: " + ", ".join(f"{x:.3f}" for x in cores) + " cores per repetition")
    return "\n".join(lines) + "\n"


def _ok_ttfts(res: dict[str, Any]) -> list[float]:
    """TTFTs of the requests that succeeded (vLLM's result lists failed ones with an error and TTFT 0)."""
    errors = res.get("errors") or [""] * len(res["ttfts"])
    return [t for t, e in zip(res["ttfts"], errors, strict=False) if not e]


def _tpots(res: dict[str, Any]) -> list[float]:
    return [sum(itl) / len(itl) for itl in res["itls"] if itl]


def _nixl_tune_env(delay_us: int, *, unpin: bool = True) -> dict[str, str]:
    """Environment for a vLLM NIXL server: progress-thread delay and/or no KV core pin (see the shim)."""
    env: dict[str, str] = {}
    if delay_us > 0:
        env["KVPUSH_NIXL_PTHR_DELAY_US"] = str(delay_us)
        env["UCX_RCACHE_MAX_UNRELEASED"] = "1024"
    if unpin:
        env["KVPUSH_VLLM_NO_KV_CORE_PIN"] = "1"
    if env:
        here = Path(__file__).with_name("_nixl_sitecustomize")
        env["PYTHONPATH"] = f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def _summarize(
    conns: list[str],
    points: list[tuple[int, float]],
    samples: dict[tuple[str, float, int], dict[str, list[float]]],
    idle: dict[str, list[float]],
    ready: dict[str, list[float]],
    calibration: dict[int, float] | None = None,
) -> dict[str, Any]:
    rows = []
    calibration = calibration or {}
    lines = [
        "| input | QPS | prefill load | "
        + " | ".join(f"{c} TTFT p50 ms" for c in conns)
        + " | "
        + " | ".join(f"kvpush/{c} TTFT [95% CI]" for c in conns if c != "kvpush")
        + " |"
    ]
    lines.append("|" + "---|" * (3 + len(conns) + len([c for c in conns if c != "kvpush"])))
    for n, q in points:
        row: dict[str, Any] = {"input": n, "qps": q}
        load = f"{q * calibration[n]:.2f}" if n in calibration else "n/a"
        row["offered_prefill_load"] = q * calibration[n] if n in calibration else None
        cells = []
        for c in conns:
            t = samples.get((c, q, n), {}).get("ttft", [])
            med = 1000 * statistics.median(t) if t else float("nan")
            row[f"{c}_ttft_p50_ms"] = med
            tp = samples.get((c, q, n), {}).get("tpot", [])
            row[f"{c}_tpot_p50_ms"] = 1000 * statistics.median(tp) if tp else float("nan")
            cells.append(f"{med:.1f}")
        ratios = []
        for c in conns:
            if c == "kvpush" or "kvpush" not in conns:
                continue
            r, lo, hi = bootstrap_ratio(
                samples.get(("kvpush", q, n), {}).get("ttft", []),
                samples.get((c, q, n), {}).get("ttft", []),
            )
            row[f"kvpush_over_{c}"] = [r, lo, hi]
            ratios.append(f"{r:.2f} [{lo:.2f}, {hi:.2f}]")
        rows.append(row)
        lines.append(f"| {n} | {q:g} | {load} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines.append("")
    lines.append(
        "Idle CPU of each set-up's engine processes (cores): "
        + ", ".join(f"{c} {statistics.fmean(v):.3f}" for c, v in idle.items())
    )
    if ready.get("kvpush"):
        rd = sorted(ready["kvpush"])
        lines.append(
            f"kvpush registration -> decode-ready: median {1000 * statistics.median(rd):.1f} ms, "
            f"p90 {1000 * rd[int(0.9 * (len(rd) - 1))]:.1f} ms over {len(rd)} requests"
        )
    return {
        "rows": rows,
        "idle_cores": idle,
        "kvpush_ready_s": ready.get("kvpush", []),
        "table_md": "\n".join(lines) + "\n",
    }


def _load_samples(
    out_dir: Path,
) -> tuple[list[str], list[tuple[int, float]], dict[tuple[str, float, int], dict[str, list[float]]]]:
    """Re-read the per-point JSON files (all repetitions pooled)."""
    samples: dict[tuple[str, float, int], dict[str, list[float]]] = {}
    conns: list[str] = []
    points: set[tuple[int, float]] = set()
    for f in sorted(out_dir.glob("*_qps*_in*_out*_iter*.json")):
        res = json.loads(f.read_text())
        c = res.get("connector") or f.name.split("_qps")[0]
        q = float(res["request_rate"])
        n = int(f.name.split("_in")[1].split("_")[0])
        if c not in conns:
            conns.append(c)
        points.add((n, q))
        s = samples.setdefault((c, q, n), {"ttft": [], "tpot": []})
        s["ttft"] += _ok_ttfts(res)
        s["tpot"] += _tpots(res)
    order = [c for c in CONNECTORS if c in conns]
    return order, sorted(points), samples


def _plot(
    out_dir: Path,
    conns: list[str],
    points: list[tuple[int, float]],
    samples: dict[tuple[str, float, int], dict[str, list[float]]],
) -> None:
    """vllm_ttft.png and vllm_tpot.png: one panel per input length, median per point, whiskers = IQR."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    in_lens = sorted({n for n, _ in points})
    for metric in ("ttft", "tpot"):
        fig, axes = plt.subplots(1, len(in_lens), figsize=(5 * len(in_lens), 4), squeeze=False)
        for j, n in enumerate(in_lens):
            ax = axes[0][j]
            qs = sorted(q for m, q in points if m == n)
            for k, c in enumerate(conns):
                xs, ys, lo, hi = [], [], [], []
                for q in qs:
                    v = sorted(samples.get((c, q, n), {}).get(metric) or [])
                    if not v:
                        continue
                    med = 1000 * statistics.median(v)
                    xs.append(q * (1 + 0.03 * (k - 1)))
                    ys.append(med)
                    lo.append(med - 1000 * v[int(0.25 * (len(v) - 1))])
                    hi.append(1000 * v[int(0.75 * (len(v) - 1))] - med)
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=c)
            ax.set_title(f"{metric.upper()} median (IQR), input {n} tokens")
            ax.set_xlabel("request rate (QPS)")
            ax.set_ylabel("ms")
            ax.set_xticks(qs)
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"vllm_{metric}.png", dpi=100)
        plt.close(fig)


def plot_only(out_dir: Path) -> None:
    conns, points, samples = _load_samples(out_dir)
    _plot(out_dir, conns, points, samples)


def points_from_loads(prefill_s: dict[int, float], loads: list[float]) -> list[tuple[int, float]]:
    """(input, QPS) points that offer each prefill engine the given fractions of its capacity.

    A 1P1D set-up saturates when arrivals x prefill time reaches 1; above that every connector's TTFT is
    the queue's growth over the run, not the transfer. QPS are rounded to two significant digits so the
    file names stay readable; the offered load is recorded with each point.
    """
    out: list[tuple[int, float]] = []
    for n, t in prefill_s.items():
        if t <= 0:
            raise ValueError(f"prefill time for {n} tokens must be positive, got {t}")
        for load in loads:
            if not 0 < load < 1.5:
                raise ValueError(f"load {load} is outside (0, 1.5): it is a fraction of prefill capacity")
            out.append((n, float(f"{load / t:.2g}")))
    return out


def calibrate_prefill(
    model: str,
    in_lens: list[int],
    log_dir: Path,
    seed: int,
    tries: int = 3,
    confine: bool = True,
    kv_cache_gib: float = 4.0,
) -> dict[int, float]:
    """Median time for one engine alone (no connector, the prefill engine's core) to prefill each prompt
    length: the unit that --loads is measured in."""
    from .serve_pd import start_single

    out: dict[int, float] = {}
    dep = start_single(model, log_dir, confine=confine, env={"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"})
    try:
        client.stream_complete(dep.url, model, "warm up", 2, timeout=120)
        for n in in_lens:
            prompts = client.make_prompts(tries, [_words_for_tokens(n)], seed=seed + 7 * n)
            times = []
            for p in prompts:
                r = client.stream_complete(dep.url, model, p, 1, timeout=300)
                if not r.ok:
                    raise RuntimeError(f"calibration request of {n} tokens failed: {r.error}")
                times.append(r.ttft)
            out[n] = statistics.median(times)
    finally:
        dep.stop()
    return out
