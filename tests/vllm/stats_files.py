"""Reading the engines' kvpush stats files (stats_dir) in the real-vLLM tests.

A worker hands its counters to a writer thread after each engine step that saw news, and that thread
rewrites the file a moment later; right after a client's last answer either file may still be a step or
more behind. Two stale files can even agree (send_bytes == recv_bytes over the same earlier transfers),
so waiting for equal bytes alone is not enough: a test waits until both sides have published the outcome
of every transfer it made, and asserts on that one pair of snapshots.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def read_stats(stats_dir: Path, role: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """One worker's last published stats (rank 0), waiting for the first file to appear."""
    path = Path(stats_dir) / f"kvpush-{role}-rank0.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    out: dict[str, Any] = json.loads(path.read_text())
    return out


def outcomes(stats: dict[str, Any]) -> int:
    """Transfers this worker has counted as over, ok or failed (prefill: pushes, decode: receives)."""
    if stats["role"] == "prefill":
        return int(stats["sent_ok"]) + int(stats["sent_failed"])
    return int(stats["recv_ok"]) + int(stats["recv_failed"])


def settled(
    stats_dir: Path, transfers: int, timeout_s: float = 30.0, poll_s: float = 0.25
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill, decode) stats once each side has published the outcome of at least `transfers`
    transfers; an AssertionError names what each side said last if they never do."""
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = read_stats(stats_dir, "prefill"), read_stats(stats_dir, "decode")
        if outcomes(p) >= transfers and outcomes(d) >= transfers:
            return p, d
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"after {timeout_s:.0f} s the stats still count {outcomes(p)} pushes and {outcomes(d)} "
                f"receives over, not {transfers}: prefill {p}, decode {d}"
            )
        time.sleep(poll_s)
