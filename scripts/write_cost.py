#!/usr/bin/env python3
"""kvpush's own work per WRITE, before and after, side by side in one run.

Exports kvpush (and backends/) at a base commit into a temporary directory, then alternates the same
`kvpush demo` command (small requests, one at a time, no references) between that tree and this checkout,
`--rounds` times each, so both see the same box and the same load. Prints, per tree, the median over its
rounds of each run's p50 (microseconds): the stages of the push thread's timeline (wake, plan, seal,
queue, make; kvpush.endpoint.prefill.TIMELINE) and kvpush_per_write = trigger -> made (no copy), and
writes everything to --json.

    python scripts/write_cost.py --base 4d7336b --rounds 3 --json out/write_cost.json

`--base none` runs this checkout alone (a machine without git history, e.g. the GPU box's copy).
`--variant name=--flag` (repeatable; several flags: `name="--a --b"`) adds a column: this checkout again
with those extra demo flags, e.g. `--variant no_arm=--no-source-blocks` beside the armed default.
`armed_per_write` is kvpush_per_write over the small requests whose WRITE was made ahead (source_blocks);
`registration_last_per_write` / `prefill_done_last_per_write` split it by the event that came last (the
demo alternates the two orders); `registration_last_<stage>` are that order's own stages.

The base must have the timeline marks (picked, sealed, queued: commit 4d7336b and later); the demo that
runs is the tree's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = [
    "--num-prompts",
    "64",
    "--min-tokens",
    "16",
    "--max-tokens",
    "256",
    "--window",
    "1",
    "--no-references",
]
STAGE_KEYS = ("wake", "plan", "seal", "queue", "make")  # the timeline's stages before the copy
KEYS = (
    "kvpush_per_write",
    "armed_per_write",
    "registration_last_per_write",
    "prefill_done_last_per_write",
    *STAGE_KEYS,
    "copy",
    "trigger_to_posted",
    "prefill_done_call",
    *(f"registration_last_{stage}" for stage in STAGE_KEYS),
)


def export(commit: str, into: Path) -> Path:
    """kvpush and backends/ at `commit`, laid out as the installed package (backends -> kvpush.backends)."""
    into.mkdir(parents=True)
    tar = into / "tree.tar"
    with open(tar, "wb") as f:
        subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "kvpush", "backends"], stdout=f, check=True
        )
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    shutil.move(str(into / "backends"), str(into / "kvpush" / "backends"))
    return into


def run_demo(pythonpath: str | None, out: Path, extra: list[str]) -> dict[str, Any]:
    env = dict(os.environ, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN")
    if pythonpath:  # the base tree; this checkout runs with the caller's own environment
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "kvpush.cli", "demo", *DEMO, *extra, "--output-json", str(out)]
    proc = subprocess.run(
        cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise SystemExit(f"demo failed ({pythonpath or 'this checkout'}):\n{proc.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.read_text())
    if res["verified"] != res["requests"]:
        raise SystemExit(f"demo verified {res['verified']} of {res['requests']} requests")
    return res


def row(res: dict[str, Any]) -> dict[str, float]:
    tl = res["timeline_p50_us_small"]
    got = {k: float(v) for k, v in tl.get("stages", {}).items()}
    got["kvpush_per_write"] = float(tl.get("kvpush_per_write", tl["trigger_to_made"]))
    got["trigger_to_posted"] = float(tl["trigger_to_posted"])
    if "prefill_done_call_us_small" in res:  # the engine thread's time inside prefill_done
        got["prefill_done_call"] = float(res["prefill_done_call_us_small"]["p50"])
    for order, cost in tl.get("per_write_by_order", {}).items():  # trees from 2026-12-04 on
        got[f"{order}_per_write"] = float(cost)
    last_stages = tl.get("stages_by_order", {}).get("registration_last", {})  # trees from 2026-12-06 on
    for stage in STAGE_KEYS:
        if stage in last_stages:
            got[f"registration_last_{stage}"] = float(last_stages[stage])
    armed = res.get("timeline_p50_us_small_armed")
    if armed and armed.get("requests"):
        got["armed_per_write"] = float(armed["kvpush_per_write"])
    return got


def variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name or not flags:
        raise argparse.ArgumentTypeError(f"--variant takes name=--flag, got {text!r}")
    return name, flags.split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base",
        default="4d7336b",
        help="the 'before' commit (default: timeline marks only); 'none': this checkout's columns only",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", dest="json_path", default="")
    ap.add_argument(
        "--variant",
        type=variant,
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also run this checkout with these extra demo flags, as column NAME",
    )
    ap.add_argument("demo_args", nargs="*", help="extra `kvpush demo` flags (after --)")
    args = ap.parse_args()
    trees: list[tuple[str, str | None, list[str]]] = [("before", "", [])] if args.base != "none" else []
    trees += [("after", None, [])]
    trees += [(name, None, flags) for name, flags in args.variant]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in trees}
    with tempfile.TemporaryDirectory(prefix="kvpush-write-cost-") as tmp:
        base = export(args.base, Path(tmp) / "base") if args.base != "none" else Path(tmp)
        for i in range(args.rounds):
            for name, path, flags in trees:
                where = str(base) if path == "" else path
                res = run_demo(where, Path(tmp) / f"{name}-{i}.json", args.demo_args + flags)
                runs[name].append(row(res))
                print(f"round {i + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    table = {
        name: {
            k: round(statistics.median(r[k] for r in rs if k in r), 1)
            for k in KEYS
            if any(k in r for r in rs)
        }
        for name, rs in runs.items()
    }
    head = f"{'p50 us (median of ' + str(args.rounds) + ' runs)':<34}"
    width = {name: max(10, len(name) + 2) for name in runs}
    print(head + "".join(f"{name:>{width[name]}}" for name in runs))
    for k in KEYS:
        cells = (f"{table[name].get(k, float('nan')):>{width[name]}.1f}" for name in runs)
        print(f"{k:<34}" + "".join(cells))
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "base": args.base,
                    "demo": DEMO + args.demo_args,
                    "variants": {name: flags for name, flags in args.variant},
                    "runs": runs,
                    "p50": table,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
