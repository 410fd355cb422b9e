"""A failure's kind crosses the wire: what the prefill's SendResult names, the decode's RecvResult names
too (before, the TransferFailed carried text only and the decode said REMOTE), over the in-memory transport
and the real side channel, each notice encoded and sealed as on any wire."""

from __future__ import annotations

import time

from kvpush.protocol.reasons import Failure
from tests.endpoint.test_endpoints import pair
from tests.endpoint.util import until

__all__ = ["pair"]  # the fixture, imported for these tests


def test_a_write_the_data_plane_failed_is_write_failed_on_both_sides(pair):
    hub, src, dst, p, d, addr = pair
    hub.fail_next_writes["D-agent"] = 1
    d.expect("bad", [0], 8, addr)
    time.sleep(0.05)
    p.prefill_done("bad", [0, 1], 8)
    [sent] = until(p.finished)
    [got] = until(d.finished)
    assert not sent.ok and sent.failure is Failure.WRITE_FAILED
    assert not got.ok and got.failure is Failure.WRITE_FAILED and "WRITE failed" in got.reason


def test_a_token_count_the_prefill_refuses_is_refused_on_both_sides(pair):
    hub, src, dst, p, d, addr = pair
    d.expect("odd", [0, 1], 16, addr)  # the decode wants 16 tokens; the prefill has 8
    time.sleep(0.05)
    p.prefill_done("odd", [0, 1], 8)
    [sent] = until(p.finished)
    [got] = until(d.finished)
    assert not sent.ok and sent.failure is Failure.REFUSED
    assert not got.ok and got.failure is Failure.REFUSED and got.reason.startswith("prefill rank 0:")
