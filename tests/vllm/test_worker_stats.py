"""The workers' stats file: the snapshot's shape and the publisher's pacing (no engine, no vLLM)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvpush.platforms.vllm.stats import StatsPublisher, snapshot
from kvpush.protocol.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, block_size=16, num_blocks=8, total_kv_heads=2, head_dim=64, dtype_size=2)


def test_snapshot_puts_the_role_counters_beside_the_endpoints_stats():
    ep = {"bytes": 4096, "registration_first": 3, "prefill_first": 1, "pending": 2}
    snap = snapshot("decode", "dec-0", 1, LAYOUT, {"recv_ok": 4}, 5, ep)
    assert (
        snap["recv_ok"] == 4 and snap["role"] == "decode" and snap["rank"] == 1 and snap["outstanding"] == 5
    )
    assert snap["compat"] == LAYOUT.compat_hash() and snap["bytes_per_token"] == LAYOUT.bytes_per_token
    assert snap["endpoint"] == ep and snap["order_counts"] == {"registration_first": 3, "prefill_first": 1}
    assert snap["pending"] == 2
    json.dumps(snap)  # what the writer thread receives
    assert "compat" not in snapshot("prefill", "p", 0, None, {}, 0, {})


def test_publisher_builds_on_news_at_once_and_otherwise_at_most_every_period(tmp_path: Path):
    built: list[int] = []

    def build() -> dict[str, int]:
        built.append(len(built))
        return {"n": len(built)}

    pub = StatsPublisher(tmp_path / "w.json", build, every_s=3600)
    try:
        pub.publish(news=True)
        pub.publish()  # within the period, no news: not even built
        pub.publish()
        assert built == [0]
        pub.publish(news=True)
        assert built == [0, 1]
    finally:
        pub.close()  # the final snapshot is written synchronously
    assert json.loads((tmp_path / "w.json").read_text()) == {"n": 3}
    assert not any(t.name == "kvpush-stats" and t.is_alive() for t in threading.enumerate())
