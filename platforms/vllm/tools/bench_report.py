"""`kvpush bench-vllm`'s report: medians per point, kvpush / baseline ratios with bootstrap intervals,
the markdown tables of summary.md, and the figures (redrawn from the per-point files by --plot-only)."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

from .serve_pd import CONNECTORS


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
    for arm, times in push.items():  # every kvpush arm (one-piece, streamed)
        if not times:
            continue
        p = sorted(times)
        lines.append(
            f"{arm} prefill hand-over -> WRITE complete (KV in decode memory): median "
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
    for arm, times in ready.items():  # every kvpush arm
        if not times:
            continue
        rd = sorted(times)
        lines.append(
            f"{arm} registration -> decode-ready: median {1000 * statistics.median(rd):.1f} ms, "
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
    order = [c for c in CONNECTORS if c in conns] + [c for c in conns if c not in CONNECTORS]
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
