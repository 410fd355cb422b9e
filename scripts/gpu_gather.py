"""GPU check (issue 11 item 6): a fragmented request moved two ways between two NIXL agents on VRAM.

  paged:  the request's blocks as one prepared descriptor per (plane, block), reposted (what a paged push
          of that fragmentation costs NIXL over cuda_ipc / cuda_copy);
  gather: one torch gather kernel copies the request's blocks of every plane into a registered staging
          slot, one WRITE of the whole slot (>= 256 KiB descriptors; here one descriptor), and one scatter
          kernel on the receiving side; timed end to end (gather + WRITE + scatter, synchronised).

Both run in one process with two agents (UCX picks cuda_ipc or cuda_copy). Prints one JSON line.
Usage: python scripts/gpu_gather.py [num_layers=32] [tokens=16384] [run_blocks=8] [reps=5]
Written without a GPU in the session that added it: it has not run yet.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 32
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
RUN = int(sys.argv[3]) if len(sys.argv) > 3 else 8
REPS = int(sys.argv[4]) if len(sys.argv) > 4 else 5
BS, HEADS, DIM = 16, 8, 128  # block of 16 tokens x 8 KV heads x 128 x 2 bytes = 32 KiB per plane
BB = BS * HEADS * DIM * 2
PLANES = 2 * LAYERS
NB = 4 * (TOKENS // BS)
N = TOKENS // BS


def agent(name: str) -> nixl_agent:
    cfg = nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        backends=["UCX"],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    return nixl_agent(name, cfg)


def table(seed: int) -> list[int]:
    runs = [list(range(s, min(s + RUN, NB))) for s in range(0, NB, RUN)]
    random.Random(seed).shuffle(runs)
    return [b for r in runs for b in r][:N]


def wait(a: nixl_agent, b: nixl_agent, h: object) -> None:
    while True:
        s = a.check_xfer_state(h)
        if s == "DONE":
            return
        if s == "ERR":
            raise RuntimeError("transfer ERR")
        b.get_new_notifs()


def main() -> None:
    dev = torch.device("cuda:0")
    src = torch.randint(0, 255, (PLANES, NB, BB), dtype=torch.uint8, device=dev)
    dst = torch.zeros((PLANES, NB, BB), dtype=torch.uint8, device=dev)
    s_stage = torch.empty((PLANES, N, BB), dtype=torch.uint8, device=dev)
    d_stage = torch.empty((PLANES, N, BB), dtype=torch.uint8, device=dev)
    A, B = agent("gather-A"), agent("gather-B")
    for ag, tensors in ((A, (src, s_stage)), (B, (dst, d_stage))):
        ag.register_memory([(t.data_ptr(), t.numel(), 0, "") for t in tensors], "VRAM")
    peer = A.add_remote_agent(B.get_agent_metadata())
    B.add_remote_agent(A.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    s_tab, d_tab = table(1), table(2)

    # paged: one descriptor per (plane, block); runs of RUN blocks could merge, so this is NIXL's floor
    # for this fragmentation only after merging consecutive indices (make_prepped_xfer does that)
    rows = lambda t: np.array([[t.data_ptr(), BB, 0, BB, PLANES * NB]], dtype=np.int64)  # noqa: E731
    L = A.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src), "VRAM")
    R = A.prep_xfer_dlist(peer, rows(dst), "VRAM")
    p = np.arange(PLANES, dtype=np.int64)[:, None] * NB
    li = (p + np.asarray(s_tab)[None, :]).ravel().astype(np.int32)
    ri = (p + np.asarray(d_tab)[None, :]).ravel().astype(np.int32)
    h = A.make_prepped_xfer("WRITE", L, li, R, ri, notif_msg=b"paged")
    paged = []
    for _ in range(REPS + 1):
        t0 = time.perf_counter()
        A.transfer(h)
        wait(A, B, h)
        paged.append(time.perf_counter() - t0)
    ok_paged = bool(torch.equal(dst[:, d_tab], src[:, s_tab]))
    dst.zero_()

    # gather -> one WRITE -> scatter
    hs = A.initialize_xfer(
        "WRITE",
        A.get_xfer_descs([(s_stage.data_ptr(), s_stage.numel(), 0)], "VRAM"),
        A.get_xfer_descs([(d_stage.data_ptr(), d_stage.numel(), 0)], "VRAM"),
        peer,
        b"staged",
    )
    s_idx = torch.tensor(s_tab, device=dev)
    d_idx = torch.tensor(d_tab, device=dev)
    staged = []
    for _ in range(REPS + 1):
        t0 = time.perf_counter()
        torch.index_select(src, 1, s_idx, out=s_stage)  # one gather kernel over every plane
        torch.cuda.synchronize()
        A.transfer(hs)
        wait(A, B, hs)
        dst.index_copy_(1, d_idx, d_stage)  # one scatter kernel on the receiving side
        torch.cuda.synchronize()
        staged.append(time.perf_counter() - t0)
    ok_staged = bool(torch.equal(dst[:, d_tab], src[:, s_tab]))
    nbytes = PLANES * N * BB
    med = lambda v: statistics.median(v[1:])  # noqa: E731 - first rep is the warm-up
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "descriptors_before_merge": int(li.shape[0]),
                "run_blocks": RUN,
                "paged_gbps": round(nbytes / med(paged) / 1e9, 2),
                "gather_write_scatter_gbps": round(nbytes / med(staged) / 1e9, 2),
                "bytes_verified": ok_paged and ok_staged,
            }
        )
    )


if __name__ == "__main__":
    main()
