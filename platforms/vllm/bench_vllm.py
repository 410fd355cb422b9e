"""`kvpush bench-vllm`: kvpush vs vLLM's NixlPushConnector vs NixlConnector (pull) on real vLLM.

One run drives the set-ups one after another on the same machine with the same workload and seed:
repetitions alternate the order (A B C, then C B A, ...), each repetition starts its servers afresh,
and every (QPS, input length) point sends Poisson arrivals of the same prompts. Each point writes a
vllm-bench-compatible JSON file `<connector>_qps<q>_in<in>_out<out>_iter<i>.json`; the summary holds
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvpush.platforms.vllm import client
from kvpush.platforms.vllm.serve_pd import CONNECTORS, Deployment, start_pd

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


def idle_cpu(dep: Deployment, seconds: float = 5.0) -> float:
    """Cores the set-up's engine processes burn while no request is in flight."""
    pids = _tree_pids(dep)
    a = _cpu_seconds(pids)
    time.sleep(seconds)
    return (_cpu_seconds(pids) - a) / seconds


def run_point(
    url: str, model: str, prompts: list[str], qps: float, out_len: int, seed: int, timeout_s: float = 600.0
) -> dict[str, Any]:
    rng = random.Random(seed)
    results: list[client.StreamResult | None] = [None] * len(prompts)
    t0 = time.perf_counter()

    def one(i: int) -> None:
        results[i] = client.stream_complete(
            url, model, prompts[i], out_len, timeout=timeout_s, request_id=f"b{seed}-{i}-{time.time_ns()}"
        )

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        at = 0.0
        futs = []
        for i in range(len(prompts)):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            futs.append(pool.submit(one, i))
            at += rng.expovariate(qps) if qps > 0 else 0.0
        for f in futs:
            f.result()
    duration = time.perf_counter() - t0
    ok = [r for r in results if r is not None and r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2el = [r.latency for r in ok]

    def stats(name: str, xs: list[float]) -> dict[str, float]:
        if not xs:
            return {
                f"mean_{name}_ms": 0.0,
                f"median_{name}_ms": 0.0,
                f"std_{name}_ms": 0.0,
                f"p99_{name}_ms": 0.0,
            }
        s = sorted(xs)
        return {
            f"mean_{name}_ms": 1000 * statistics.fmean(s),
            f"median_{name}_ms": 1000 * statistics.median(s),
            f"std_{name}_ms": 1000 * (statistics.pstdev(s) if len(s) > 1 else 0.0),
            f"p99_{name}_ms": 1000 * s[min(len(s) - 1, int(0.99 * len(s)))],
        }

    out: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "model_id": model,
        "tokenizer_id": model,
        "num_prompts": len(prompts),
        "request_rate": qps,
        "burstiness": 1.0,
        "duration": duration,
        "completed": len(ok),
        "failed": len(prompts) - len(ok),
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        "input_lens": [r.prompt_tokens for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": ttfts,
        "itls": [r.itl for r in ok],
        "errors": [r.error for r in results if r is not None and not r.ok],
        "generated_texts": [r.text if r is not None and r.ok else None for r in results],
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2el)):
        out.update(stats(name, xs))
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
    parser.add_argument("--qps", default="1,4", help="comma-separated request rates")
    parser.add_argument("--input-lens", default="1024,4096", help="comma-separated prompt lengths (words)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--reps", type=int, default=2)
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
        default="nixl-pull",
        help="vLLM connectors that get --nixl-prog-delay-us (NixlPushConnector deadlocks its "
        "prefill engine with the shim on this machine, see docs/vllm.md)",
    )
    parser.add_argument("--request-timeout", type=float, default=180.0, help="per-request client timeout (s)")
    parser.add_argument("--warmup-tries", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true", help="only redraw the figures from --result-dir")
    parser.add_argument("--warmup-timeout", type=float, default=60.0)


def _words_for_tokens(n: int) -> int:
    return max(1, n // 2)  # the tiny tokenizer gives about 2 tokens per corpus word


def run(args: argparse.Namespace) -> int:
    from kvpush.platforms.vllm.tiny_model import build

    if args.plot_only:
        plot_only(Path(args.result_dir))
        return 0
    model = args.model or str(build(args.variant))
    conns = [c.strip() for c in args.connectors.split(",") if c.strip()]
    for c in conns:
        if c not in CONNECTORS:
            raise SystemExit(f"unknown connector {c!r}; choose from {', '.join(CONNECTORS)}")
    qps_list = [float(q) for q in args.qps.split(",")]
    in_lens = [int(x) for x in args.input_lens.split(",")]
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = {
        n: client.make_prompts(args.num_prompts, [_words_for_tokens(n)], seed=args.seed + n) for n in in_lens
    }
    samples: dict[tuple[str, float, int], dict[str, list[float]]] = {}
    idle: dict[str, list[float]] = {}
    ready: dict[str, list[float]] = {}
    env_tune = _nixl_tune_env(args.nixl_prog_delay_us)
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
            env = dict(env_tune) if conn in tune_conns else {}
            if conn != "kvpush":
                env["VLLM_LOGGING_LEVEL"] = "INFO"  # its periodic "KV Transfer metrics" lines
            print(f"[rep {rep}] starting {conn}", flush=True)
            log_dir = out_dir / "logs" / f"{conn}-{rep}"
            dep = start_pd(
                conn, model, log_dir, prefill_extra=extra, decode_extra=extra, prefill_env=env, decode_env=env
            )
            try:
                warm = _warm_up(dep.url, model, args.warmup_tries, args.warmup_timeout)
                warmups.setdefault(conn, []).append(warm)
                print(f"  warm-up: {warm}", flush=True)
                if not warm["ok"]:
                    print(f"  {conn} never answered a warm-up request; skipping its points", flush=True)
                    continue
                idle.setdefault(conn, []).append(idle_cpu(dep, args.idle_seconds))
                for n in in_lens:
                    for q in qps_list:
                        res = run_point(
                            dep.url,
                            model,
                            prompts[n],
                            q,
                            args.output_len,
                            args.seed + rep,
                            args.request_timeout,
                        )
                        res["connector"] = conn
                        name = f"{conn}_qps{q:g}_in{n}_out{args.output_len}_iter{rep}.json"
                        (out_dir / name).write_text(json.dumps(res))
                        texts.setdefault((conn, q, n), []).append(res["generated_texts"])
                        s = samples.setdefault((conn, q, n), {"ttft": [], "tpot": []})
                        s["ttft"] += res["ttfts"]
                        s["tpot"] += [(r) for r in _tpots(res)]
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
    summary = _summarize(conns, qps_list, in_lens, samples, idle, ready)
    summary["extra_md"] = _extras_md(conns, qps_list, in_lens, samples, texts, warmups, push, xfer, idle)
    summary["table_md"] += summary["extra_md"]
    summary["warmups"] = warmups
    summary["kvpush_push_s"] = push.get("kvpush", [])
    summary["vllm_xfer_ms"] = {c: v for c, v in xfer.items()}
    summary["args"] = vars(args)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "summary.md").write_text(summary["table_md"])
    print(summary["table_md"])
    _plot(out_dir, conns, qps_list, in_lens, samples)
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
    qps_list: list[float],
    in_lens: list[int],
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
    for n in in_lens:
        for q in qps_list:
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
    for c, v in xfer.items():
        tot = sum(k for k, _ in v)
        if tot:
            avg = sum(k * ms for k, ms in v) / tot
            lines.append(
                f"{c}: vLLM's own 'Avg xfer time' (count-weighted over its 10 s log windows, both "
                f"engines' lines): {avg:.1f} ms over {tot} transfers"
            )
    for c, v in idle.items():
        lines.append(f"Idle CPU {c}: " + ", ".join(f"{x:.3f}" for x in v) + " cores per repetition")
    return "\n".join(lines) + "\n"


def _tpots(res: dict[str, Any]) -> list[float]:
    return [sum(itl) / len(itl) for itl in res["itls"] if itl]


def _nixl_tune_env(delay_us: int) -> dict[str, str]:
    if delay_us <= 0:
        return {}
    here = Path(__file__).with_name("_nixl_sitecustomize")
    return {
        "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
        "KVPUSH_NIXL_PTHR_DELAY_US": str(delay_us),
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
    }


def _summarize(
    conns: list[str],
    qps_list: list[float],
    in_lens: list[int],
    samples: dict[tuple[str, float, int], dict[str, list[float]]],
    idle: dict[str, list[float]],
    ready: dict[str, list[float]],
) -> dict[str, Any]:
    rows = []
    lines = [
        "| input | QPS | "
        + " | ".join(f"{c} TTFT p50 ms" for c in conns)
        + " | "
        + " | ".join(f"kvpush/{c} TTFT [95% CI]" for c in conns if c != "kvpush")
        + " |"
    ]
    lines.append("|" + "---|" * (2 + len(conns) + len([c for c in conns if c != "kvpush"])))
    for n in in_lens:
        for q in qps_list:
            row: dict[str, Any] = {"input": n, "qps": q}
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
            lines.append(f"| {n} | {q:g} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines.append("")
    lines.append(
        "Idle CPU of each set-up's engine processes (cores): "
        + ", ".join(f"{c} {statistics.fmean(v):.3f}" for c, v in idle.items())
    )
    if ready.get("kvpush"):
        r = sorted(ready["kvpush"])
        lines.append(
            f"kvpush registration -> decode-ready: median {1000 * statistics.median(r):.1f} ms, "
            f"p90 {1000 * r[int(0.9 * (len(r) - 1))]:.1f} ms over {len(r)} requests"
        )
    return {
        "rows": rows,
        "idle_cores": idle,
        "kvpush_ready_s": ready.get("kvpush", []),
        "table_md": "\n".join(lines) + "\n",
    }


def _load_samples(
    out_dir: Path,
) -> tuple[list[str], list[float], list[int], dict[tuple[str, float, int], dict[str, list[float]]]]:
    """Re-read the per-point JSON files (all repetitions pooled)."""
    samples: dict[tuple[str, float, int], dict[str, list[float]]] = {}
    conns: list[str] = []
    qs: set[float] = set()
    ns: set[int] = set()
    for f in sorted(out_dir.glob("*_qps*_in*_out*_iter*.json")):
        res = json.loads(f.read_text())
        c = res.get("connector") or f.name.split("_qps")[0]
        q = float(res["request_rate"])
        n = int(f.name.split("_in")[1].split("_")[0])
        if c not in conns:
            conns.append(c)
        qs.add(q)
        ns.add(n)
        s = samples.setdefault((c, q, n), {"ttft": [], "tpot": []})
        s["ttft"] += res["ttfts"]
        s["tpot"] += _tpots(res)
    order = [c for c in CONNECTORS if c in conns]
    return order, sorted(qs), sorted(ns), samples


def _plot(
    out_dir: Path,
    conns: list[str],
    qps_list: list[float],
    in_lens: list[int],
    samples: dict[tuple[str, float, int], dict[str, list[float]]],
) -> None:
    """vllm_ttft.png and vllm_tpot.png: median per point, whiskers = 25th-75th percentile."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for metric in ("ttft", "tpot"):
        fig, axes = plt.subplots(1, len(in_lens), figsize=(5 * len(in_lens), 4), squeeze=False)
        for j, n in enumerate(in_lens):
            ax = axes[0][j]
            for k, c in enumerate(conns):
                xs, ys, lo, hi = [], [], [], []
                for q in qps_list:
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
            ax.set_xticks(qps_list)
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"vllm_{metric}.png", dpi=100)
        plt.close(fig)


def plot_only(out_dir: Path) -> None:
    conns, qs, ns, samples = _load_samples(out_dir)
    _plot(out_dir, conns, qs, ns, samples)
