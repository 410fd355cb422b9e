"""The demo's block views (kvpush/apps/demo/mirror.py): a device cache moves only a request's blocks to and
from the host, with the same bytes as the whole-cache copy it replaces.

The "device" here is a CPU torch tensor standing in for CudaKVCache (same attributes: layout, tensor,
device_type "cuda", to_host/from_host); the row arithmetic is what is tested, not CUDA."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.apps.demo.mirror import DeviceMirror, HostView, LayerUpload, WholeCopy, block_view
from kvpush.apps.demo.pattern import count_wrong_bytes, fill, scrub
from kvpush.protocol.layout import KVLayout, packed_planes

torch = pytest.importorskip("torch")


class StandInDeviceCache:
    """CudaKVCache's demo-facing surface over a CPU tensor (a stand-in: no GPU here)."""

    device_type = "cuda"

    def __init__(self, layout: KVLayout, seed: int) -> None:
        gen = np.random.default_rng(seed)
        per_plane = layout.num_blocks * layout.block_stride
        nbytes = (
            layout.cache_bytes if layout.block_major else per_plane * layout.num_layers * layout.kv_per_layer
        )
        self.tensor = torch.from_numpy(gen.integers(0, 256, nbytes, dtype=np.uint8))
        self.layout = packed_planes(layout, int(self.tensor.data_ptr()))

    def to_host(self) -> np.ndarray:
        return self.tensor.numpy().copy()

    def from_host(self, host: np.ndarray) -> None:
        self.tensor.copy_(torch.from_numpy(host))


def geometry(**kw: object) -> KVLayout:
    base = dict(num_layers=3, block_size=4, num_blocks=20, total_kv_heads=2, head_dim=8, dtype_size=2)
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_a_request_fills_and_checks_through_its_blocks_alone(order: str) -> None:
    cache, reference = (
        StandInDeviceCache(geometry(token_order=order), 1),
        StandInDeviceCache(geometry(token_order=order), 1),
    )
    view = block_view(cache)
    assert isinstance(view, DeviceMirror)
    blocks, n = [7, 2, 11], 10  # three blocks, the last one partly used
    fill(view.pull(blocks), cache.layout, blocks, n, request_tag=5)
    view.push(blocks)
    whole = reference.to_host()  # what the whole-cache round trip did
    fill(whole, reference.layout, blocks, n, request_tag=5)
    reference.from_host(whole)
    assert torch.equal(cache.tensor, reference.tensor)  # the same bytes, every other block untouched

    decode_view = block_view(cache)  # a fresh mirror (the decode's), reading the device's bytes
    host = decode_view.pull(blocks)
    assert count_wrong_bytes(host, cache.layout, blocks, n, 5) == 0
    assert count_wrong_bytes(host, cache.layout, blocks, n, 6) > 0  # another request's tag fails
    scrub(host, cache.layout, blocks)
    decode_view.push(blocks)
    scrub(whole, reference.layout, blocks)
    reference.from_host(whole)
    assert torch.equal(cache.tensor, reference.tensor)  # zeroed there, nothing else changed


def test_a_cache_the_rows_cannot_address_is_copied_whole_and_a_host_cache_is_its_own_view() -> None:
    cache = StandInDeviceCache(geometry(block_major=True), 2)
    view = block_view(cache)
    assert isinstance(view, WholeCopy)
    fill(view.pull([3]), cache.layout, [3], 4, request_tag=9)
    view.push([3])
    assert count_wrong_bytes(cache.to_host(), cache.layout, [3], 4, 9) == 0

    class Host:
        layout = geometry()
        buffer = np.zeros(1, dtype=np.uint8)

        def to_host(self) -> np.ndarray:
            return self.buffer

    host = Host()
    hv = block_view(host)
    assert isinstance(hv, HostView) and hv.pull([0]) is host.buffer


def test_a_layered_upload_moves_one_layer_of_the_requests_blocks_at_a_time_and_nothing_else() -> None:
    """The streamed demo's GPU prefill (procs._cuda_layered_prefill) lands a request layer by layer through
    LayerUpload: after layer l only layers 0..l of its blocks hold the pattern, and no other block is
    written, not even one the device changed after the pattern was made (a whole-plane copy would have
    put the mirror's stale bytes back there)."""
    lay = geometry(num_layers=4)
    cache = StandInDeviceCache(lay, 3)
    view = block_view(cache)
    assert isinstance(view, DeviceMirror)
    blocks, n = [9, 1, 14], 11
    before = cache.tensor.clone()
    fill(view.pull(blocks), cache.layout, blocks, n, request_tag=4)
    upload = LayerUpload(view, blocks, lay.num_layers)
    other = [b for b in range(lay.num_blocks) if b not in blocks]
    rows = cache.tensor.view(-1, lay.block_bytes)
    kvs = lay.kv_per_layer
    first = [
        cache.layout.plane(layer, kv).offset // lay.block_bytes for layer in range(4) for kv in range(kvs)
    ]
    for p in first:
        rows[p + other[0]] = 77  # the device moved on after the pattern was made
    moved = cache.tensor.clone()
    want = reference_bytes(lay, before, blocks, n, tag=4)
    for layer in range(lay.num_layers):
        upload.enqueue(layer)
        for plane, p in enumerate(first):
            done = plane // kvs <= layer
            for b in blocks:
                got, expect = rows[p + b], want.view(-1, lay.block_bytes)[p + b]
                assert torch.equal(got, expect if done else moved.view(-1, lay.block_bytes)[p + b])
            for b in other:
                assert torch.equal(rows[p + b], moved.view(-1, lay.block_bytes)[p + b])
    assert count_wrong_bytes(cache.to_host(), cache.layout, blocks, n, 4) == 0


def reference_bytes(lay: KVLayout, before: object, blocks: list[int], n: int, tag: int) -> object:
    """The cache's bytes with the request's pattern filled in over the whole cache (the definition)."""
    ref = StandInDeviceCache(lay, 0)
    ref.tensor.copy_(before)  # type: ignore[arg-type]
    whole = ref.to_host()
    fill(whole, ref.layout, blocks, n, request_tag=tag)
    ref.from_host(whole)
    return ref.tensor
