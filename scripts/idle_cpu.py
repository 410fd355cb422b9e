"""Idle CPU of kvpush's background threads: a prefill and a decode endpoint, handshaken, no traffic.
With --waiting, decode has expected one request whose prefill never finishes (a decode waiting through
a long prefill): the receive thread polls for its notification, backing off to max_busy_poll_s.

Reads each thread's run time from /proc/self/task/TID/schedstat over --seconds. Usage:
    python scripts/idle_cpu.py --seconds 20
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvpush.apps.procstat import thread_run_ns
from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig, SideChannel
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout


def thread_cpu_ns(tid: int) -> int:
    ns = thread_run_ns("self", tid)
    if ns is None:
        raise RuntimeError(f"thread {tid} is gone")
    return ns


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--waiting", action="store_true", help="decode waits for one request meanwhile")
    args = ap.parse_args()
    geo = dict(num_layers=4, total_kv_heads=1, head_dim=128, dtype_size=2)
    src = HostKVCache(KVLayout(block_size=16, num_blocks=64, **geo))
    dst = HostKVCache(KVLayout(block_size=16, num_blocks=64, **geo))
    with (
        PrefillEndpoint(KVPushConfig(engine_id="P", side_channel=SideChannel(port=0)), src.layout) as p,
        DecodeEndpoint(KVPushConfig(engine_id="D"), dst.layout) as d,
    ):
        where = PrefillAddress("P", *p.address)
        d.connect(where)
        if args.waiting:
            d.expect("never-prefilled", [0, 1], 32, where)
        time.sleep(1.0)
        tids = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("kvpush-")}
        before = {n: thread_cpu_ns(t) for n, t in tids.items() if t}
        wall0, cpu0 = time.monotonic(), time.process_time()
        time.sleep(args.seconds)
        wall = time.monotonic() - wall0
        for name, tid in tids.items():
            if tid:
                pct = 100 * (thread_cpu_ns(tid) - before[name]) / 1e9 / wall
                print(f"{name}: {pct:.2f}% of a core")
        state = "one request waiting" if args.waiting else "idle"
        print(
            f"whole process (both endpoints, {state}): {100 * (time.process_time() - cpu0) / wall:.2f}% of a core"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
