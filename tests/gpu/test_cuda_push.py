"""GPU checks (run by scripts/gpu_check.sh on a CUDA machine; skipped where no GPU is visible).

VRAM caches registered with NIXL as VRAM; KV pushed between two processes and every byte verified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible (these checks run on the GPU machine)", allow_module_level=True)

from kvpush.backends.cuda import CudaKVCache  # noqa: E402
from kvpush.protocol.layout import KVLayout  # noqa: E402
from kvpush.protocol.plan import build_plan  # noqa: E402
from kvpush.transport.nixl import NixlTransport, prepare_environment  # noqa: E402

ENV = dict(os.environ, NIXL_LOG_LEVEL="WARN")


def test_vram_plan_write_lands_every_byte_in_process():
    prepare_environment("lo")
    geo = dict(num_layers=4, total_kv_heads=2, head_dim=128, dtype_size=2)
    src = CudaKVCache(KVLayout(block_size=16, num_blocks=64, **geo))
    dst = CudaKVCache(KVLayout(block_size=32, num_blocks=32, **geo))
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8, device="cuda"))
    a, b = NixlTransport("gpu-a"), NixlTransport("gpu-b")
    a.register(src.layout.regions, "VRAM")
    b.register(dst.layout.regions, "VRAM")
    peer = a.add_peer(b.metadata())
    s_blocks = [3, 4, 5, 9, 10, 20, 21, 22, 23, 40]
    d_blocks = [7, 2, 3, 11, 12]
    n = 150
    plan = build_plan(src.layout, dst.layout, s_blocks, d_blocks, n)
    local, remote = plan.nixl_descs()
    h = a.post_write(peer, local, remote, b"done", "VRAM")
    deadline = time.monotonic() + 30
    while a.poll(h) == "PROC":
        b.drain_notifs()
        assert time.monotonic() < deadline
    a.release(h)
    got: list = []
    while not got and time.monotonic() < deadline:
        got = b.drain_notifs()
    assert got and got[0][1] == b"done"
    s_host, d_host = src.to_host(), dst.to_host()
    s0, d0 = src.layout.regions[0].addr, dst.layout.regions[0].addr
    for sa, da, ln in zip(plan.src_addr.tolist(), plan.dst_addr.tolist(), plan.length.tolist(), strict=True):
        assert np.array_equal(s_host[sa - s0 : sa - s0 + ln], d_host[da - d0 : da - d0 + ln])
    assert plan.nbytes == n * 4 * 2 * 2 * 256


@pytest.mark.parametrize("extra", [[], ["--prefill-tp", "2", "--kv-heads", "2", "--token-order", "HND"]])
def test_demo_pushes_vram_between_processes(tmp_path, extra):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpush.cli",
            "demo",
            "--device",
            "cuda",
            "--requests",
            "12",
            "--max-tokens",
            "8192",
            "--layers",
            "8",
            "--output",
            str(out),
            *extra,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cuda" and res["verified"] == res["requests"] == 12 and res["failed"] == 0
