"""Decode side of tests/gpu/test_cuda_handoff.py, in its own process on the same GPU.

argv[1]: JSON with mode ("vram" or "staged"), the prefill's engine id, host and port, the geometry,
source and destination blocks and tokens. Allocates a zeroed VRAM cache, expects the request, prints
EXPECTING, waits for it, then checks every byte of the destination cache against the pattern the prefill
wrote (and that every other block is still zero) and prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvpush.protocol.layout import KVLayout


def pattern(layer: int, kv: int, src_block: int, nbytes: int) -> np.ndarray:
    """The bytes the prefill writes into plane (layer, kv) of its source block `src_block`."""
    base = np.arange(nbytes, dtype=np.int64) * 31 + layer * 131 + kv * 17 + src_block * 7 + 1
    return (base % 251 + 1).astype(np.uint8)  # never 0, so an unwritten (zero) byte always differs


def main() -> int:
    args = json.loads(sys.argv[1])
    from kvpush.backends.cuda import CudaKVCache
    from kvpush.backends.staging import HostStaging
    from kvpush.config import KVPushConfig
    from kvpush.endpoint import DecodeEndpoint, PrefillAddress

    lay = KVLayout(**args["geometry"])
    dst = CudaKVCache(lay)
    staging = HostStaging(dst) if args["mode"] == "staged" else None
    cfg = KVPushConfig.from_mapping(dict(engine_id="gpu-decode", lease_s=60.0, ready_timeout_s=90.0))
    if staging is None:
        d = DecodeEndpoint(cfg, dst.layout, "VRAM")
    else:
        d = DecodeEndpoint(cfg, staging.layout, staging.mem_type, hooks=staging)
    d.start()
    try:
        where = PrefillAddress(args["engine_id"], args["host"], args["port"])
        d.expect("req", args["d_blocks"], args["tokens"], where)
        print("EXPECTING", flush=True)
        got: list = []
        deadline = time.monotonic() + 90
        while not got and time.monotonic() < deadline:
            got = d.finished()
            time.sleep(0.002)
        t_ready = time.time()
    finally:
        d.close()
    host = dst.to_host()
    bad = 0
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_per_layer):
            p = dst.layout.plane(layer, kv)

            def block(b: int, p=p) -> np.ndarray:
                start = p.offset + b * lay.block_stride
                return host[start : start + lay.block_bytes]

            for s, dblk in zip(args["s_blocks"], args["d_blocks"], strict=True):
                bad += not np.array_equal(block(dblk), pattern(layer, kv, s, lay.block_bytes))
            for b in set(range(lay.num_blocks)) - set(args["d_blocks"]):
                bad += bool(block(b).any())
    result = {
        "finished": [{"ok": r.ok, "reason": r.reason} for r in got],
        "bad_blocks": bad,
        "t_ready": t_ready,
        "staging": staging.stats() if staging else None,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
