"""An aborted decode request ends within one resend interval of a live prefill, even when the prefill's
answer to the Abort is lost (issue 16 finding 8: an early client disconnect left decode requests holding
their blocks until the fence, with the prefill clean). Endpoints over the in-memory transport."""

from __future__ import annotations

import time

import pytest

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout
from kvpush.protocol.reasons import Failure
from kvpush.protocol.receiver import PrefillRankState, ReceiverState, SendAbort
from kvpush.protocol.wire import TransferFailed
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.util import until

GEO = dict(num_layers=2, total_kv_heads=2, head_dim=8, dtype_size=2)
LEASES = dict(lease_s=20.0, ready_timeout_s=30.0)  # fence at 30 + 10 + 1 s: far beyond the test


class LosesNotifications(MemoryTransport):
    """Drops the next `drop` notifications it receives (a lost answer), then delivers again."""

    drop = 0
    dropped = 0

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        got = super().drain_notifs()
        while got and self.drop:
            got.pop(0)
            self.drop -= 1
            self.dropped += 1
        return got


@pytest.fixture
def lossy_pair():
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    dst = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, **LEASES)),
        src.layout,
        transport=MemoryTransport("P-agent", hub),
    )
    d_transport = LosesNotifications("D-agent", hub)
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", ping_interval_s=0.5, peer_timeout_s=5.0, **LEASES)),
        dst.layout,
        transport=d_transport,
    )
    p.start()
    d.start()
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    yield d_transport, p, d, addr
    d.close()
    p.close()


def test_a_lost_answer_to_an_abort_costs_one_resend_not_the_fence(lossy_pair):
    d_transport, p, d, addr = lossy_pair
    d.expect("gone-client", [1, 2], 8, addr)  # the prefill never runs this request
    time.sleep(0.2)  # the registration is in
    d_transport.drop = 1  # the prefill's answer to the Abort is lost
    t0 = time.monotonic()
    d.abort("gone-client", "client went away")
    [got] = until(d.finished, timeout=5.0)
    took = time.monotonic() - t0
    assert d_transport.dropped == 1
    assert not got.ok and got.block_ids == (1, 2) and got.failure is Failure.ABORTED
    assert took < 3.0, f"ended after {took:.1f}s: the Abort was not sent again"
    assert d.pending() == 0


def test_an_answered_abort_ends_at_once_and_is_not_repeated(lossy_pair):
    d_transport, p, d, addr = lossy_pair
    d.expect("quick", [3], 4, addr)
    time.sleep(0.2)
    t0 = time.monotonic()
    d.abort("quick", "client went away")
    [got] = until(d.finished, timeout=5.0)
    assert not got.ok and time.monotonic() - t0 < 0.4  # well inside one resend interval
    assert d_transport.dropped == 0


def _state(resend_s: float) -> ReceiverState:
    return ReceiverState("D", 0, 1, 2, ready_timeout_s=30.0, write_bound_s=11.0, abort_resend_s=resend_s)


def test_receiver_resends_an_unanswered_abort_only_to_ranks_that_may_still_answer():
    st = _state(1.0)
    st.expect("r", (1,), 4, prefill_tp=1, now=0.0)
    [first] = [a for a in st.abort("r", "gone", now=1.0) if isinstance(a, SendAbort)]
    assert not first.repeat
    assert st.on_tick(1.5) == []  # not yet: one interval after the first
    [again] = st.on_tick(2.0)
    assert isinstance(again, SendAbort) and again.repeat and again.message == first.message
    assert st.on_tick(2.5) == []  # paced
    # the answer comes: settled, and nothing more is sent
    done = st.on_failed(
        TransferFailed(request_id="r", attempt=0, prefill_rank=0, reason="aborted", abandoned=False), 2.6
    )
    assert [type(a).__name__ for a in done] == ["Failed"]
    assert st.on_tick(10.0) == [] and len(st) == 0


def test_receiver_never_asks_a_rank_that_abandoned_a_write_again():
    st = _state(1.0)
    st.expect("w", (1,), 4, prefill_tp=1, now=0.0)
    msg = TransferFailed(request_id="w", attempt=0, prefill_rank=0, reason="slow", abandoned=True)
    st.on_failed(msg, 1.0)  # its bytes may land until the fence whatever it says now
    assert st.on_tick(5.0) == []
    assert st._live[("w", 0)].senders[0] is PrefillRankState.ABANDONED


def test_receiver_without_resend_waits_for_the_fence():
    st = _state(0.0)
    st.expect("r", (1,), 4, prefill_tp=1, now=0.0)
    st.abort("r", "gone", now=1.0)
    assert st.on_tick(20.0) == []  # nothing resent, nothing settled before the fence (41 s)
    [failed] = st.on_tick(41.0)
    assert type(failed).__name__ == "Failed"
