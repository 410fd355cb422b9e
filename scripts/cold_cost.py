#!/usr/bin/env python3
"""The push path's code run cold, as the push thread runs it: thread CPU time after a 2 ms sleep.

On a shared VM a thread woken from a block runs its next lines at several times their hot cost (the pages
they touch went cold), so kvpush's per-WRITE work is measured here the way it happens: each sample sleeps
first. Samples of a base commit's code (exported next to this checkout under another package name) and of
this checkout's alternate one by one in one process, so both see the same load. Prints the median thread
CPU time (microseconds) of the sender machine up to the StartWrite (the second of registration and
prefill_done), of Session.open (authenticate and decode one registration) on a connection that has
carried `--frames` frames before, and, for this checkout, of build_index_plan whole and with one side
made before.

    python scripts/cold_cost.py --base 75ed4a8 --samples 600 --frames 5000
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def nap(seconds: float) -> None:
    """Block in select() as the push thread blocks in its poll."""
    r, w = os.pipe()
    select.select([r], [], [], seconds)
    os.close(r)
    os.close(w)


def machine(pkg: str) -> tuple[Any, Any]:
    sender = importlib.import_module(pkg + ".protocol.sender")
    policy = importlib.import_module(pkg + ".protocol.ranges").StreamPolicy(0, 0, 256)
    return sender.SenderState(0, 1, 1, 60.0, 30.0, 4096, 16, policy), importlib.import_module(
        pkg + ".protocol.wire"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="75ed4a8")
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--sleep-ms", type=float, default=2.0)
    ap.add_argument("--frames", type=int, default=5000, help="frames a session opened before it is timed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpush-cold-") as tmp:
        tar = Path(tmp) / "base.tar"
        with open(tar, "wb") as f:
            subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "kvpush"], stdout=f, check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        os.rename(Path(tmp) / "kvpush", Path(tmp) / "kvpush_base")  # relative imports inside keep working
        sys.path.insert(0, tmp)
        sms = {"before": machine("kvpush_base"), "after": machine("kvpush")}
        res: dict[str, list[float]] = {}
        for i in range(args.samples):
            tree = ("before", "after")[i % 2]
            last = ("prefill_done", "registration")[(i // 2) % 2]
            st, wire = sms[tree]
            rid = f"r{i}"
            reg = wire.Registration(
                request_id=rid, attempt=0, decode_engine_id="d", decode_rank=0, decode_tp=1,
                block_ids=list(range(i % 50, i % 50 + 4)), num_tokens=100, expires_at=time.monotonic() + 100,
            )  # fmt: skip
            now = time.monotonic()
            if last == "prefill_done":
                st.on_registration(reg, now, 32)
            else:
                st.on_prefill_done(rid, tuple(range(7)), 100, now)
            nap(args.sleep_ms / 1e3)
            t0 = time.thread_time_ns()
            if last == "prefill_done":
                out = st.on_prefill_done(rid, tuple(range(7)), 100, now)
            else:
                out = st.on_registration(reg, now, 32)
            res.setdefault(f"machine, {last} last, {tree}", []).append((time.thread_time_ns() - t0) / 1e3)
            st.on_write_done(rid, out[0].attempt, 0, True, 1000, "", now)
        for tree, pkg in (("before", "kvpush_base"), ("after", "kvpush")):
            res[f"Session.open after {args.frames} frames, {tree}"] = opens(pkg, args)
    res.update(plans(args.samples, args.sleep_ms / 1e3))
    for k, v in res.items():
        print(f"{k:<44}{statistics.median(v):8.1f} us")
    return 0


def opens(pkg: str, args: argparse.Namespace) -> list[float]:
    """Thread CPU time of opening one sealed Registration, cold, on a session `args.frames` frames old."""
    hs, wire = (
        importlib.import_module(pkg + ".protocol.handshake"),
        importlib.import_module(pkg + ".protocol.wire"),
    )
    codec = wire.Codec()
    dec = hs.Session(codec, b"k" * 32, b"n" * 16, b"m" * 16, "decode")
    pre = hs.Session(codec, b"k" * 32, b"n" * 16, b"m" * 16, "prefill")
    for i in range(args.frames):
        pre.open(dec.seal(wire.Ping(clock=float(i))))
    out = []
    for i in range(args.samples // 4):
        reg = wire.Registration(
            request_id=f"r{i}", attempt=0, decode_engine_id="d", decode_rank=0, decode_tp=1,
            block_ids=[1, 2, 3, 4], num_tokens=100, expires_at=1e9,
        )  # fmt: skip
        frame = dec.seal(reg)
        nap(args.sleep_ms / 1e3)
        t0 = time.thread_time_ns()
        pre.open(frame)
        out.append((time.thread_time_ns() - t0) / 1e3)
    return out


def plans(samples: int, sleep_s: float) -> dict[str, list[float]]:
    """build_index_plan of a 16-256-token request (the demo's geometry), whole or with a side made before."""
    import numpy as np

    from kvpush.apps.demo.procs import Geometry
    from kvpush.backends.host import HostKVCache
    from kvpush.protocol.prepared import build_index_plan, half_plan, pair_units

    src = HostKVCache(Geometry(16, 1, 128, 2, 16, 600, 1).layout(0))
    dst = HostKVCache(Geometry(16, 1, 128, 2, 32, 300, 1).layout(0))
    pair = pair_units(src.layout, dst.layout, (0, 1))
    rng = np.random.default_rng(0)
    out: dict[str, list[float]] = {}
    for i in range(samples):
        kind = ("whole", "source made before", "decode side made before")[i % 3]
        n = int(rng.integers(16, 257))
        s = tuple(sorted(int(x) for x in rng.permutation(600)[: -(-n // 16)]))
        d = [int(x) for x in rng.permutation(300)[: -(-n // 32)]]
        sh = half_plan(pair, False, s, n) if kind.startswith("source") else None
        dh = half_plan(pair, True, d, n) if kind.startswith("decode") else None
        nap(sleep_s)
        t0 = time.thread_time_ns()
        build_index_plan(pair, s, d, n, halves=(sh, dh))
        out.setdefault(f"plan, {kind}", []).append((time.thread_time_ns() - t0) / 1e3)
    return out


if __name__ == "__main__":
    sys.exit(main())
