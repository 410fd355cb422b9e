"""CUDA event hand-off and host staging from VRAM, two processes on one GPU (run by scripts/gpu_check.sh;
skipped where torch sees no CUDA device).

The prefill (this process) queues a deliberately slow kernel (torch.cuda._sleep) on a side stream and,
behind it on the same stream, the kernel that writes the KV pattern; then it calls prefill_done with the
CUDA event barrier recorded on that stream while the sleep still runs. The decode (tests/gpu/_decode_peer.py,
another process) registered its blocks first, so the push could start at once: only the barrier keeps it
from reading the source before the pattern lands. The decode checks every destination byte (and that no
other block changed). "vram": both caches registered with NIXL as VRAM. "staged": both registered through
HostStaging (device -> host on the push thread after the barrier, host -> device before ready).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

PEER = Path(__file__).resolve().parent / "_decode_peer.py"
GEOMETRY = dict(num_layers=4, block_size=16, num_blocks=64, total_kv_heads=2, head_dim=128, dtype_size=2)
S_BLOCKS = [3, 4, 5, 9, 10, 20, 21, 40]
D_BLOCKS = [7, 2, 3, 11, 12, 13, 30, 31]
TOKENS = len(S_BLOCKS) * GEOMETRY["block_size"]
SLEEP_S = 2.0  # the slow kernel's length, sized from a measured clock rate; checked still running at hand-off
STACKS_AFTER_S = 0.5  # the engine-thread calls (queue, record, hand off) taking longer than this: dump stacks


def _peer_module() -> Any:
    spec = importlib.util.spec_from_file_location("kvpush_gpu_decode_peer", PEER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


@pytest.mark.parametrize("mode", ["vram", "staged"])
def test_kv_written_by_a_slow_kernel_is_not_pushed_early(mode: str, tmp_path: Path) -> None:
    import torch

    from kvpush.apps.demo.procs import sleep_cycles_per_s
    from kvpush.backends.cuda import CudaKVCache, cuda_event_barrier
    from kvpush.backends.staging import HostStaging
    from kvpush.config import KVPushConfig
    from kvpush.endpoint import PrefillEndpoint
    from kvpush.protocol.layout import KVLayout

    pattern = _peer_module().pattern
    lay = KVLayout(**GEOMETRY)
    src = CudaKVCache(lay)
    # index and bytes of the pattern, built and uploaded before anything is timed
    idx_parts, pat_parts = [], []
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_per_layer):
            p = src.layout.plane(layer, kv)
            for s in S_BLOCKS:
                start = p.offset + s * lay.block_stride
                idx_parts.append(np.arange(start, start + lay.block_bytes, dtype=np.int64))
                pat_parts.append(pattern(layer, kv, s, lay.block_bytes))
    idx = torch.from_numpy(np.concatenate(idx_parts)).cuda()
    pat = torch.from_numpy(np.concatenate(pat_parts)).cuda()
    # The kernel the engine thread queues behind the sleep, launched once here on a scratch copy: CUDA
    # loads a kernel on its first launch (lazy loading, Linux's default since CUDA 12.2) and a load may
    # wait for the context to go idle, i.e. for the 2 s sleep. The 2026-12-04 [vram] failure fits that:
    # "vram" runs first, so its index_copy_ was the process's first; "staged", second, passed.
    torch.zeros_like(src.tensor).index_copy_(0, idx, pat)
    torch.cuda.synchronize()

    staging = HostStaging(src) if mode == "staged" else None
    cfg = KVPushConfig.from_mapping(dict(engine_id="gpu-prefill", port=0, lease_s=60.0, ready_timeout_s=90.0))
    if staging is None:
        pe = PrefillEndpoint(cfg, src.layout, "VRAM")
    else:
        pe = PrefillEndpoint(cfg, staging.layout, staging.mem_type, hooks=staging)
    pe.start()
    peer = None
    peer_log = tmp_path / "decode_peer.log"
    stacks_file = (tmp_path / "stacks.txt").open("w")  # closed in the finally, whatever happens
    try:
        host, port = pe.address
        args = dict(mode=mode, engine_id="gpu-prefill", host=host, port=port, geometry=GEOMETRY,
                    s_blocks=S_BLOCKS, d_blocks=D_BLOCKS, tokens=TOKENS)  # fmt: skip
        with peer_log.open("w") as err:  # the child keeps its own handle
            peer = subprocess.Popen(
                [sys.executable, str(PEER), json.dumps(args)],
                stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ),
            )  # fmt: skip
        assert peer.stdout is not None
        line = peer.stdout.readline()
        assert line.strip() == "EXPECTING", line + _tail(peer_log)
        time.sleep(1.0)  # let the registration reach the prefill: the WRITE may then start at hand-off

        rate = sleep_cycles_per_s(0)
        stream = torch.cuda.Stream()
        # if an engine-thread call below blocks, faulthandler's own C thread (it needs no GIL, so it runs
        # even if another thread holds the GIL inside a C call) writes every thread's Python stack here
        faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False, file=stacks_file)
        t_queued = time.monotonic()
        stamps: dict[str, float] = {}  # when each engine-thread call returned, after queueing the sleep
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(rate * SLEEP_S))
            stamps["sleep"] = time.monotonic() - t_queued
            src.tensor.index_copy_(0, idx, pat)  # the "KV" lands only after the sleep
            stamps["index_copy_"] = time.monotonic() - t_queued
        written = torch.cuda.Event()
        written.record(stream)
        stamps["record"] = time.monotonic() - t_queued
        barrier = cuda_event_barrier(stream=stream)
        stamps["barrier"] = time.monotonic() - t_queued
        t0 = time.monotonic()
        pe.prefill_done("req", S_BLOCKS, TOKENS, kv_written=barrier)
        handoff_s = time.monotonic() - t0
        faulthandler.cancel_dump_traceback_later()
        running_at_handoff = not written.query()
        since_queued_s = time.monotonic() - t_queued
        while not written.query():
            time.sleep(0.0005)
        t_written = time.time()
        kernel_s = time.monotonic() - t_queued

        out, _ = peer.communicate(timeout=120)
        assert peer.returncode == 0, _tail(peer_log)
        result = json.loads(out.strip().splitlines()[-1])
        sent: list[Any] = []
        deadline = time.monotonic() + 30
        while not sent and time.monotonic() < deadline:
            sent = pe.finished()
            time.sleep(0.01)
    finally:
        faulthandler.cancel_dump_traceback_later()  # (again) whatever raised before the hand-off
        stacks_file.close()
        if peer is not None and peer.poll() is None:
            peer.kill()
            peer.wait()
        pe.close()

    timing = (
        f"clock {rate / 1e9:.2f} G sleep-cycles/s, kernel done {kernel_s:.3f} s after queueing, "
        f"prefill_done took {handoff_s:.3f} s, hand-off checked {since_queued_s:.3f} s after queueing; "
        + ", ".join(f"{k} returned at {v:.3f} s" for k, v in stamps.items())
    )
    stacks = (tmp_path / "stacks.txt").read_text()
    if stacks:  # a call took over STACKS_AFTER_S: where every thread was then
        timing += f"; every thread's stack {STACKS_AFTER_S} s after queueing:\n{stacks}"
    assert running_at_handoff, f"the slow kernel had finished before prefill_done ({timing}): proves nothing"
    assert handoff_s < 0.2, f"prefill_done waited ({timing}): the engine thread must not wait"
    assert result["finished"] == [{"ok": True, "reason": ""}], result
    assert sent and sent[0].ok, sent
    assert result["bad_blocks"] == 0, result  # every destination byte is the pattern, nothing else changed
    assert result["t_ready"] >= t_written - 0.05, (result["t_ready"], t_written)
    if staging is not None:
        per_side = TOKENS * lay.bytes_per_token
        assert staging.stats()["bytes"] == per_side == result["staging"]["bytes"], (staging.stats(), result)
