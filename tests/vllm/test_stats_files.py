"""The stats-file wait of the real-vLLM tests: two stale files that agree on bytes are not taken as the
end state (test_stream_vllm once read sent_ok 9 of 12 right after send_bytes == recv_bytes held)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.vllm.stats_files import outcomes, settled

MIB = 1 << 20


def _write(stats_dir: Path, role: str, ok: int, nbytes: int) -> None:
    if role == "prefill":
        body = {"role": role, "sent_ok": ok, "sent_failed": 0, "send_bytes": nbytes}
    else:
        body = {"role": role, "recv_ok": ok, "recv_failed": 0, "recv_bytes": nbytes}
    tmp = stats_dir / f"kvpush-{role}-rank0.tmp"
    tmp.write_text(json.dumps(body))
    tmp.replace(stats_dir / f"kvpush-{role}-rank0.json")  # as the writer thread does: atomically


def test_settled_waits_past_two_stale_files_that_agree_on_bytes(tmp_path: Path) -> None:
    for role in ("prefill", "decode"):
        _write(tmp_path, role, 9, 9 * MIB)  # both a step behind the client's 12 answers, and equal
    timer = threading.Timer(0.4, lambda: [_write(tmp_path, r, 12, 12 * MIB) for r in ("prefill", "decode")])
    timer.start()
    try:
        p, d = settled(tmp_path, 12, timeout_s=10.0, poll_s=0.05)
    finally:
        timer.cancel()
    assert (p["sent_ok"], d["recv_ok"], p["send_bytes"], d["recv_bytes"]) == (12, 12, 12 * MIB, 12 * MIB)


def test_settled_names_both_sides_when_they_never_catch_up(tmp_path: Path) -> None:
    _write(tmp_path, "prefill", 12, 12 * MIB)
    _write(tmp_path, "decode", 11, 11 * MIB)
    with pytest.raises(AssertionError, match="12 pushes and 11 receives over, not 12"):
        settled(tmp_path, 12, timeout_s=0.2, poll_s=0.05)


def test_failed_transfers_count_as_over() -> None:
    assert outcomes({"role": "prefill", "sent_ok": 3, "sent_failed": 2}) == 5
    assert outcomes({"role": "decode", "recv_ok": 1, "recv_failed": 4}) == 5
