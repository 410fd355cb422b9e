"""One side of the two-host engine-API push (tests/e2e/test_netns_push.py), run inside a namespace.

    python netns_peer.py prefill CONFIG.json N      # fills N requests' blocks, pushes them, prints stats
    python netns_peer.py decode CONFIG.json N PREFILL_HOST PORT

The config file is a kvpush config as docs/deploy.md tells a user to write it (flat keys, key by file).
The decode checks every byte of every request against the pattern the prefill wrote.
"""

from __future__ import annotations

import json
import sys
import time

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.apps.demo.procs import Geometry, make_cache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint

GEO = Geometry(
    block_size=16,
    num_blocks=64,
    tp_size=1,
    layers=4,
    total_kv_heads=2,
    head_dim=64,
    dtype_size=2,
    token_order="NHD",
)
TOKENS = 40  # 3 blocks each


def blocks(i: int, base: int) -> list[int]:
    return [base + 3 * i, base + 3 * i + 1, base + 3 * i + 2]


def until_done(ep: PrefillEndpoint | DecodeEndpoint, n: int, timeout: float = 60.0) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += ep.finished()
        time.sleep(0.01)
    return got


def main() -> None:
    role, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(path) as f:
        config = KVPushConfig.from_mapping(json.load(f))
    cache = make_cache(GEO.layout(0), "cpu")
    if role == "prefill":
        ep: PrefillEndpoint | DecodeEndpoint = PrefillEndpoint(config, cache.layout)
        ep.start()
        print("listening", *ep.address, flush=True)
        for i in range(n):
            fill(cache.buffer, cache.layout, blocks(i, 1), TOKENS, request_tag=i + 1)
            ep.prefill_done(f"r{i}", blocks(i, 1), TOKENS)
        results = until_done(ep, n)
        print(json.dumps({"ok": sum(1 for r in results if getattr(r, "ok", False)), "stats": ep.stats()}))
    else:
        ep = DecodeEndpoint(config, cache.layout)
        ep.start()
        addr = PrefillAddress("P", sys.argv[4], int(sys.argv[5]), 1)
        ep.connect(addr, 60.0)
        for i in range(n):
            ep.expect(f"r{i}", blocks(i, 20), TOKENS, addr)
        results = until_done(ep, n)
        wrong = sum(
            count_wrong_bytes(cache.buffer, cache.layout, blocks(i, 20), TOKENS, i + 1) for i in range(n)
        )
        ok = sum(1 for r in results if getattr(r, "ok", False))
        print(json.dumps({"ok": ok, "wrong_bytes": wrong, "bytes": ep.stats().get("bytes", 0)}))
    ep.close()


if __name__ == "__main__":
    main()
