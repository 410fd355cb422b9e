"""The engine-agnostic API in one file: a prefill rank pushes one request's KV to a decode rank.

Both endpoints live in this process here (each with its own NIXL agent); in a real deployment they sit in
the prefill and decode engines' worker processes. Run: python examples/engine_api.py
"""

from __future__ import annotations

import time

import numpy as np

from kvpush import DecodeEndpoint, KVLayout, KVPushConfig, PrefillAddress, PrefillEndpoint
from kvpush.backends.host import HostKVCache
from kvpush.config import SideChannel, Streaming


def main() -> int:
    geometry = dict(num_layers=8, total_kv_heads=1, head_dim=128, dtype_size=2)
    prefill_cache = HostKVCache(KVLayout(block_size=16, num_blocks=256, **geometry))
    decode_cache = HostKVCache(KVLayout(block_size=32, num_blocks=128, **geometry))
    prefill_cache.buffer[:] = np.random.default_rng(0).integers(0, 256, prefill_cache.nbytes, dtype=np.uint8)

    prefill = PrefillEndpoint(
        # streaming: ranges of >= 256 ready tokens move before prefill_done (default 1024)
        KVPushConfig(
            engine_id="prefill-0", side_channel=SideChannel(port=0), streaming=Streaming(min_tokens=256)
        ),
        prefill_cache.layout,
    )
    decode = DecodeEndpoint(KVPushConfig(engine_id="decode-0"), decode_cache.layout)
    with prefill, decode:
        where = PrefillAddress("prefill-0", *prefill.address, tp_size=1)
        decode.connect(where)  # optional: handshake now, refuse an incompatible layout at start-up

        num_tokens = 1000
        decode_blocks = [5, 6, 7, *range(20, 49)]  # 32 tokens each
        prefill_blocks = list(range(100, 163))  # 16 tokens each
        # optional: the engine names the source blocks while it computes (vLLM: during the forward pass), so
        # once the decode has registered, the WRITE is planned, sealed and made ahead; prefill_done posts it
        prefill.source_blocks("req-1", prefill_blocks, num_tokens)
        decode.expect("req-1", decode_blocks, num_tokens, where)  # decode allocated: register early
        prefill.prefill_done("req-1", prefill_blocks, num_tokens)  # prefill finished: hand over

        [ready] = decode.wait_any(timeout=10)  # an engine polls decode.finished() once per step instead
        sent = []
        while not sent:
            sent = prefill.finished()  # the WRITE completed: prefill may free these blocks
        print(f"decode: {ready.request_id} ok={ready.ok} bytes={ready.nbytes} {ready.reason}")
        print(f"prefill: free {len(sent[0].block_ids)} blocks, ok={sent[0].ok}")
        src = prefill_cache.block_view(3, 1, 100 + 40 // 16)[(40 % 16) * 256 : (40 % 16 + 1) * 256]
        dst = decode_cache.block_view(3, 1, decode_blocks[40 // 32])[(40 % 32) * 256 : (40 % 32 + 1) * 256]
        print("token 40, layer 3, V equal on both sides:", bool(np.array_equal(src, dst)))
        streamed_ok = stream(prefill, decode, where, prefill_blocks, decode_blocks, num_tokens)
        return 0 if ready.ok and np.array_equal(src, dst) and streamed_ok else 1


def stream(
    prefill: PrefillEndpoint,
    decode: DecodeEndpoint,
    where: PrefillAddress,
    prefill_blocks: list[int],
    decode_blocks: list[int],
    num_tokens: int,
) -> bool:
    """Streamed push: the engine reports each prefill chunk with kv_ready (here 256 tokens, all layers);
    those WRITEs start while the next chunk computes, and prefill_done moves only the rest. The decode is
    told once, when every byte landed. (A request under streaming.min_tokens moves in one piece.)"""
    decode.expect("req-2", decode_blocks, num_tokens, where)
    for done in range(256, num_tokens, 256):  # after each chunked-prefill step
        time.sleep(0.02)  # the chunk computes (ranges reported before the registration coalesce)
        prefill.kv_ready("req-2", prefill_blocks[: -(-done // 16)], done)
    prefill.prefill_done("req-2", prefill_blocks, num_tokens)  # the terminal call, as always
    [ready] = decode.wait_any(timeout=10)
    sent = []
    while not sent:
        sent = prefill.finished()
    print(
        f"streamed: {ready.request_id} ok={ready.ok} bytes={ready.nbytes}, {prefill.stats()['writes']} WRITEs in all"
    )
    return ready.ok and sent[0].ok


if __name__ == "__main__":
    raise SystemExit(main())
