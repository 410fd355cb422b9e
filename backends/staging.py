"""Host staging: move a device cache's KV through a registered host bounce buffer.

For devices NIXL cannot register directly (trn2.3xlarge: no EFA per Neuron device; old runtimes; a
LIBFABRIC without FI_HMEM; kv_buffer_device "cpu"), the endpoint registers and plans a host mirror of the
device cache instead, and this object is its TransferHooks:

* prefill, `before_write` (push thread, after the KV-written barrier): the request's blocks device -> host;
* WRITE host -> host as usual;
* decode, `after_receive` (receive thread, before the request is reported ready): blocks host -> device.

The mirror has the device cache's geometry, planes packed in one page-aligned buffer (block ids are the
same on both, so plans are unchanged). One copy per plane per run of consecutive blocks. Its cost is
counted (`bytes_staged`, `seconds`) so demos and benchmarks can report it.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvpush.protocol.layout import KVLayout

from .base import KVCache, block_runs
from .host import HostKVCache


class HostStaging:
    """TransferHooks that stage `device` through a host mirror. Register `layout` (DRAM) with the
    endpoint: `PrefillEndpoint(config, staging.layout, staging.mem_type, hooks=staging)`."""

    mem_type = "DRAM"

    def __init__(self, device: KVCache) -> None:
        self.device = device
        self.host = HostKVCache(device.layout)
        self.layout: KVLayout = self.host.layout
        self._lock = threading.Lock()
        self.bytes_staged = 0
        self.seconds = 0.0
        self.copies = 0

    def _move(self, block_ids: tuple[int, ...], to_host: bool) -> None:
        t0 = time.perf_counter()
        dev, host = self.device.layout, self.layout
        dense = dev.block_stride == dev.block_bytes  # a run is one contiguous span only then
        runs = list(block_runs(block_ids)) if dense else [(b, 1) for b in sorted(set(block_ids))]
        moved = copies = 0
        for layer in range(dev.num_layers):
            for kv in range(dev.kv_per_layer):
                dp, hp = dev.plane(layer, kv), host.plane(layer, kv)
                for first, count in runs:
                    nbytes = (count - 1) * dev.block_stride + dev.block_bytes
                    d_off = dp.offset + first * dev.block_stride
                    h_off = hp.offset + first * host.block_stride
                    view: np.ndarray = self.host.buffer[h_off : h_off + nbytes]
                    if to_host:
                        self.device.read_into(dp.region, d_off, view)
                    else:
                        self.device.write_from(dp.region, d_off, view)
                    moved += nbytes
                    copies += 1
        with self._lock:
            self.bytes_staged += moved
            self.copies += copies
            self.seconds += time.perf_counter() - t0

    def before_write(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self._move(block_ids, to_host=True)

    def after_receive(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self._move(block_ids, to_host=False)

    def stats(self) -> dict[str, float]:
        with self._lock:
            gbps = self.bytes_staged / self.seconds / 1e9 if self.seconds else 0.0
            return {"bytes": self.bytes_staged, "copies": self.copies, "seconds": self.seconds, "GB/s": gbps}
