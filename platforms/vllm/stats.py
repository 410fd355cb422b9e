"""A worker's stats file: the snapshot, built on the engine thread, and the thread that writes it.

The worker builds an immutable snapshot (a JSON string) on the engine thread, where its state lives, at
the end of get_finished and whenever it has news; a small writer thread only copies the latest string to
disk. No thread ever reads the worker's own dicts.

The snapshot holds the role worker's own counters (handed-off / expected requests, bytes, per-request
latencies from the connector's hand-off) beside the endpoint's stats(). They are not folded into the
endpoint's ledger: they count only requests vLLM handed over (the endpoint also reports registration-only
requests), their latencies start at the engine step, and bench-vllm and the tests read them by name.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvpush.protocol.layout import KVLayout

log = logging.getLogger("kvpush.vllm")


def kvpush_threads() -> dict[str, int]:
    """kvpush's own threads in this process (the benchmark measures their idle CPU from /proc)."""
    return {
        t.name: t.native_id
        for t in threading.enumerate()
        if t.name.startswith("kvpush") and t.native_id is not None
    }


class StatsWriter:
    """Writes the latest published snapshot to <dir>/<engine>-rank<r>.json from its own thread.

    publish() takes an immutable JSON string built on the engine thread; the writer never looks at the
    worker's state, so nothing is shared between threads but one string reference.
    """

    def __init__(self, path: Path, period_s: float = 0.25) -> None:
        self.path = path
        self.period_s = period_s
        self._latest: str | None = None
        self._written: str | None = None
        self._news = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpush-stats", daemon=True)
        self._thread.start()

    def publish(self, snapshot: str) -> None:
        self._latest = snapshot
        self._news.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._news.wait(1.0)
            self._news.clear()
            self._flush()
            self._stop.wait(self.period_s)

    def _flush(self) -> None:
        latest = self._latest
        if latest is None or latest is self._written:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(latest)
            tmp.replace(self.path)
            self._written = latest
        except OSError as exc:
            log.warning("kvpush: cannot write stats to %s: %s", self.path, exc)

    def close(self, final: str | None = None) -> None:
        self._stop.set()
        self._news.set()
        self._thread.join(5)
        if final is not None:
            self._latest = final
        self._flush()


def snapshot(
    role: str,
    engine_id: str,
    rank: int,
    layout: KVLayout | None,
    counters: Mapping[str, Any],
    outstanding: int,
    endpoint: Mapping[str, int],
) -> dict[str, Any]:
    """One worker's stats: its role counters, who it is, its layout's identity and the endpoint's stats."""
    out: dict[str, Any] = dict(counters)
    out.update(
        role=role,
        engine_id=engine_id,
        rank=rank,
        pid=os.getpid(),
        time=time.time(),
        threads=kvpush_threads(),
        outstanding=outstanding,
    )
    if layout is not None:
        out["compat"] = layout.compat_hash()
        out["bytes_per_token"] = layout.bytes_per_token
        out["atomic_blocks"] = layout.atomic_blocks
    out["endpoint"] = dict(endpoint)
    out["order_counts"] = {k: endpoint[k] for k in ("registration_first", "prefill_first") if k in endpoint}
    out["pending"] = endpoint.get("pending")
    return out


class StatsPublisher:
    """Hands a StatsWriter the worker's snapshot: at once when a request changed state (news), otherwise
    at most every `every_s` while the engine steps. Called on the engine thread only."""

    def __init__(self, path: Path, build: Callable[[], dict[str, Any]], every_s: float = 0.5) -> None:
        self.build = build
        self.every_s = every_s
        self.writer = StatsWriter(path)
        self._last = 0.0

    def publish(self, news: bool = False) -> None:
        now = time.monotonic()
        if not news and now - self._last < self.every_s:
            return
        self._last = now
        self.writer.publish(json.dumps(self.build()))

    def close(self) -> None:
        self.writer.close(json.dumps(self.build()))
