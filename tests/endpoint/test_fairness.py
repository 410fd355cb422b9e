"""A flood on the side channel cannot monopolise the push thread: one loop round handles a bounded number
of messages, so WRITE progress, completions and ticks run between them (issue 12, finding 7: the old
receive loop drained every queued frame before any other work)."""

from __future__ import annotations

import time

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import MemoryControl
from kvpush.endpoint.base import EndpointCore, SendResult
from kvpush.endpoint.loop import TransferLoop
from kvpush.endpoint.prefill import MAX_MESSAGES_PER_ROUND, PushThread
from kvpush.protocol.layout import KVLayout
from kvpush.transport.memory import MemoryHub, MemoryTransport


def test_one_round_handles_a_bounded_number_of_flooded_messages():
    control = MemoryControl()
    cache = HostKVCache(
        KVLayout(num_layers=1, block_size=4, num_blocks=8, total_kv_heads=1, head_dim=8, dtype_size=2)
    )
    core = EndpointCore[SendResult](
        KVPushConfig(engine_id="P", port=0),
        "prefill",
        cache.layout,
        "DRAM",
        MemoryTransport("P-agent", MemoryHub()),
        control,
    )
    worker = TransferLoop(core.config.pacing, lambda loop: PushThread(core, loop, None)).role
    worker.setup()  # on this thread: the loop is driven by hand, one round at a time
    try:
        flooder = control.connect("127.0.0.1", worker.bound_port, 1 << 20)
        flood = 10 * MAX_MESSAGES_PER_ROUND
        for _ in range(flood):
            flooder.send(b"\x93\x01\x02\x03")  # junk: each is decoded, counted and refused
        worker.step(time.monotonic())
        handled = worker.ledger.counters.wire_errors
        assert 0 < handled <= MAX_MESSAGES_PER_ROUND, handled
        rounds = 1
        while worker.ledger.counters.wire_errors < flood:
            worker.step(time.monotonic())
            rounds += 1
            assert rounds <= flood, "the flood was never drained"
        assert rounds >= flood // MAX_MESSAGES_PER_ROUND  # it took many rounds, each bounded
    finally:
        worker.teardown()
