"""`kvpush soak`: the flags, the run, the JSON report and the summary table."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from kvpush.apps.cliutil import add_output_flags, emit_json, progress, text_to_stderr
from kvpush.apps.soak.common import SELF_CHECKS, chosen_faults
from kvpush.apps.soak.driver import Soak
from kvpush.apps.soak.report import print_report


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200)
    p.add_argument(
        "--faults",
        type=_faults,
        default="all",
        help="all, none, or fault kinds separated by commas (kvpush.apps.soak.FAULT_KINDS)",
    )
    add_output_flags(p, "the report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--fault-rate", type=float, default=0.08, help="driver faults per request, on top")
    p.add_argument("--prefill-blocks", type=int, default=1024)
    p.add_argument("--decode-blocks", type=int, default=640)
    p.add_argument(
        "--stream-share",
        type=float,
        default=0.5,
        help="share of requests the prefill reports range by range (kv_ready: by layer, by prefill "
        "chunk, or both) across its loop rounds, so faults land mid-stream",
    )
    p.add_argument(
        "--tp",
        type=_tp,
        default=(1, 1),
        metavar="P:D",
        help="prefill and decode TP (1 or 2 each; two KV heads): 2:1 has a decode rank hear from two "
        "prefill ranks, 1:2 a prefill rank write to two decode ranks",
    )
    p.add_argument(
        "--self-check",
        choices=["", *SELF_CHECKS],
        default="",
        help="break the harness on purpose (a wrong byte, a late byte, a lost block, an accepted "
        "handshake, streamed ranges reported before their KV is written) to see the matching "
        "counter rise",
    )


def run(args: argparse.Namespace) -> int:
    args.argv = getattr(args, "argv", None) or _argv(args)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    soak = Soak(args)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with progress(args.requests, "soak requests started") as update:
            watch = _Watch(lambda: update(len(soak.book.reqs)))
            try:
                report = soak.run()
            finally:
                watch.stop()
    finally:
        soak.close()
        signal.signal(signal.SIGTERM, previous)
    emit_json(args, report)
    with text_to_stderr(args):
        return print_report(report, args)


class _Watch:
    """Reports progress twice a second from its own thread (the soak's loop is not touched: it reads
    one dict's size)."""

    def __init__(self, tick: Callable[[], None]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(tick,), name="soak-progress", daemon=True)
        self._thread.start()

    def _loop(self, tick: Callable[[], None]) -> None:
        while not self._stop.wait(0.5):
            tick()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["--requests", str(args.requests), "--faults", args.faults, "--seed", str(args.seed)]
    if args.output:
        out += ["--output", args.output]
    if args.self_check:
        out += ["--self-check", args.self_check]
    out += ["--stream-share", str(args.stream_share)]
    if tuple(args.tp) != (1, 1):
        out += ["--tp", "{}:{}".format(*args.tp)]
    return out


def _tp(spec: str) -> tuple[int, int]:
    try:
        p_tp, d_tp = (int(x) for x in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp {spec!r}: expected P:D, e.g. 2:1") from None
    if not {p_tp, d_tp} <= {1, 2}:
        raise argparse.ArgumentTypeError(f"--tp {spec!r}: each side's TP must be 1 or 2 (two KV heads)")
    return p_tp, d_tp


def _faults(spec: str) -> str:
    try:
        chosen_faults(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt
