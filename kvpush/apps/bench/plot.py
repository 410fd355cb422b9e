"""`kvpush plot`: the reference's 4-panel figure (one panel per input length, QPS on x, a line per mode)."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from kvpush.apps.cliutil import alias
from kvpush.errors import ConfigError

NAME = re.compile(
    r"^(?P<mode>[a-z-]+)_qps(?P<qps>[0-9.]+)_in(?P<inl>\d+)_out(?P<out>\d+)_iter(?P<it>\d+)\.json$"
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--result-dir", dest="results_dir", metavar="DIR", default="results", help="results folder"
    )
    alias(parser, "--results-dir", "results_dir")
    parser.add_argument("--metric", choices=("ttft", "tpot", "itl", "e2el"), default="ttft")
    parser.add_argument("--stat", choices=("median", "mean", "p99"), default="median")
    parser.add_argument("--out", default=None, help="PNG path (default: <results-dir>/<metric>.png)")


def title(results_dir: Path) -> str:
    """What the runs emulated, from their own result files (model_id, model_tp), not a fixed name."""
    models = set()
    for f in sorted(results_dir.glob("*.json")):
        if NAME.match(f.name):
            res = json.loads(f.read_text())
            tp = res.get("model_tp")
            models.add(str(res.get("model_id", "unknown model")) + (f", TP{tp}" if tp else ""))
    return "; ".join(sorted(models)) or "unknown model"


def load(results_dir: Path, metric: str, stat: str) -> dict[int, dict[str, dict[float, list[float]]]]:
    data: dict[int, dict[str, dict[float, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for f in sorted(results_dir.glob("*.json")):
        m = NAME.match(f.name)
        if not m:
            continue
        res = json.loads(f.read_text())
        data[int(m["inl"])][m["mode"]][float(m["qps"])].append(float(res[f"{stat}_{metric}_ms"]))
    return data


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rd = Path(args.results_dir)
    data = load(rd, args.metric, args.stat)
    if not data:
        raise ConfigError(f"no <mode>_qps<q>_in<in>_out<out>_iter<i>.json files in {rd}")
    lens = sorted(data)
    cols = min(4, len(lens))
    rows = -(-len(lens) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    styles = {"push": ("tab:green", "o"), "pull": ("tab:red", "s"), "pull-threaded": ("tab:orange", "^")}
    for ax, n_in in zip(axes.ravel(), lens, strict=False):
        for mode, series in sorted(data[n_in].items()):
            xs = sorted(series)
            ys = [sum(series[x]) / len(series[x]) for x in xs]
            color, marker = styles.get(mode, (None, "x"))
            ax.plot(xs, ys, marker=marker, color=color, label=mode)
        ax.set_title(f"input {n_in} tokens")
        ax.set_xlabel("QPS")
        ax.set_ylabel(f"{args.stat} {args.metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.ravel()[len(lens) :]:
        ax.axis("off")
    fig.suptitle(f"kvpush bench ({title(rd)}, 1P1D): {args.stat} {args.metric.upper()}, push vs pull")
    fig.tight_layout()
    out = Path(args.out) if args.out else rd / f"{args.metric}.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0
