"""Cost of host staging (HostStaging.before_write + after_receive), no NIXL: `python tests/backends/measure_staging.py`."""

import time

import numpy as np

from kvpush.backends.host import HostKVCache
from kvpush.backends.staging import HostStaging
from kvpush.protocol.layout import KVLayout

lay = KVLayout(num_layers=16, block_size=16, num_blocks=8192, total_kv_heads=1, head_dim=128, dtype_size=2)
dev = HostKVCache(lay)
st = HostStaging(dev)
rng = np.random.default_rng(0)
for run in (1, 8, 64, 1024):
    ids = np.arange(8192).reshape(-1, run)[rng.permutation(8192 // run)].ravel()[:1024]
    blocks = tuple(int(b) for b in ids)
    st.bytes_staged = st.copies = 0
    st.seconds = 0.0
    t = time.perf_counter()
    for _ in range(3):
        st.before_write("r", blocks)
        st.after_receive("r", blocks)
    s = st.stats()
    print(
        f"runs of {run:4d} blocks: {s['bytes'] / 6 / 2**20:.0f} MiB/request each way, {s['copies'] / 6:.0f} copies, "
        f"{s['GB/s']:.2f} GB/s, {1e3 * s['seconds'] / 6:.1f} ms per direction"
    )
