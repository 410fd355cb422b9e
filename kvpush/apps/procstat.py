"""Exact CPU time of one thread, for the idle-cost measurements (scripts/idle_cpu.py, bench-vllm)."""

from __future__ import annotations

from pathlib import Path


def thread_run_ns(pid: int | str, tid: int) -> int | None:
    """Nanoseconds the thread has run, from /proc/<pid>/task/<tid>/schedstat (exact, unlike the
    tick-sampled utime/stime); None once the thread or process is gone. pid may be "self"."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
