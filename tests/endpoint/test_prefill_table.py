"""Issue 45 finding 2: the decode's table of prefill ranks. Each pairing check naming a new engine id used to
add a connection (three ZeroMQ sockets) that was never dropped and was reconnected every peer_timeout_s;
about 300 of them ran ZeroMQ out of sockets, and the TransportError in that reconnect killed the receive
thread (every later expect() raised EndpointClosed). An engine id paired first with a bogus address kept
it: a request naming the real address went to the bogus one. Now the table is bounded
(`max_prefill_peers`), ranks that never answered and that no request uses are pruned, entries are keyed
by address, and a connection that cannot be made fails that rank's requests, never the thread."""

from __future__ import annotations

import errno
import os
import time

import pytest
import zmq

from kvpush.apps.ports import free_port_range
from kvpush.endpoint import PrefillAddress
from kvpush.endpoint.control import ZmqControl
from kvpush.errors import KVPushError
from kvpush.transport.memory import MemoryHub

from .test_hardening import caches, push_ok, start_decode, start_prefill, wait

QUICK = dict(ping_interval_s=0.1, peer_timeout_s=0.3)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_hundreds_of_pairings_with_distinct_addresses_neither_kill_the_decode_nor_grow_its_table():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, **QUICK)
    d = start_decode(hub, dst, max_prefill_peers=64, **QUICK)
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        assert push_ok(p, d, addr, "before")[1].ok
        time.sleep(0.3)
        baseline = fds()
        base = free_port_range(50)  # nothing listens there: every check times out
        refused = 0
        most = 0
        for i in range(400):
            try:
                d.connect(PrefillAddress(f"bogus-{i}", "127.0.0.1", base + i % 50), timeout=0.02)
            except KVPushError:  # HandshakeTimeout, or PeerRefused (the table is full)
                refused += 1
            except zmq.ZMQError:  # before the fix: ZeroMQ out of sockets
                refused += 1
            most = max(most, len(d._recv.conns.prefills))
            if i % 50 == 49:
                time.sleep(0.4)  # > peer_timeout_s: the silent ones are reconnected (or, now, pruned)
        assert refused == 400
        assert most <= 64, f"the prefill table grew to {most} ranks (max_prefill_peers 64)"
        time.sleep(1.0)  # pruned: unused ranks that never answered, silent past peer_timeout_s
        assert not d.closed, "the receive thread died"
        rp, rd = push_ok(p, d, addr, "after")  # the real prefill is still served
        assert rp.ok and rd.ok, (rp, rd)
        assert len(d._recv.conns.prefills) <= 2, len(d._recv.conns.prefills)
        assert d.kept_state()["connect_waiters"] == 0
        assert fds() <= baseline + 8, (baseline, fds())
    finally:
        d.close()
        p.close()


class FailingControl:
    """ZeroMQ, except that connecting to the ports in `fail` raises what ZeroMQ raises when out of fds."""

    def __init__(self) -> None:
        self.inner = ZmqControl()
        self.fail: set[int] = set()

    def listen(self, host, port, max_message_bytes):
        return self.inner.listen(host, port, max_message_bytes)

    def connect(self, host, port, max_message_bytes):
        if port in self.fail:
            raise zmq.ZMQError(errno.EMFILE)
        return self.inner.connect(host, port, max_message_bytes)

    def nobody_listens(self, host, port):
        return self.inner.nobody_listens(host, port)


def test_a_reconnect_that_fails_fails_that_prefill_only_and_the_thread_serves_the_others():
    hub = MemoryHub()
    src, dst = caches()
    p1 = start_prefill(hub, src, name="P1-agent", write_timeout_s=0.5, **QUICK)
    p2 = start_prefill(hub, src, name="P2-agent", write_timeout_s=0.5, **QUICK)
    ctl = FailingControl()
    d = start_decode(hub, dst, control=ctl, write_timeout_s=0.5, **QUICK)
    a1, a2 = PrefillAddress("P", *p1.address), PrefillAddress("P", *p2.address)
    try:
        d.connect(a1)
        d.connect(a2)
        d.expect("stuck", [1, 2], 8, a1)
        time.sleep(0.2)
        ctl.fail.add(a1.port)
        p1.close()  # its connection closes: the decode reconnects at once, and that raises
        got = wait(d, timeout=10.0)[0]  # fence-bound: p1 may have held the registration
        assert not got.ok and got.request_id == "stuck" and "cannot reconnect" in got.reason, got
        assert not d.closed, "the receive thread died"
        rp, rd = push_ok(p2, d, a2, "other", blocks=(5, 6))
        assert rp.ok and rd.ok, (rp, rd)
        d.expect("to-p1", [7, 8], 8, a1)  # the failed prefill's new requests fail by name
        got = wait(d, timeout=10.0)[0]
        assert not got.ok and got.request_id == "to-p1", got
        assert not d.closed
    finally:
        d.close()
        p2.close()


def test_an_engine_id_paired_first_with_a_bogus_address_does_not_divert_the_real_one():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, **QUICK)
    d = start_decode(hub, dst, **QUICK)
    try:
        bogus = PrefillAddress("P", "127.0.0.1", free_port_range(1))  # "P" as a pairing check named it
        with pytest.raises(KVPushError):
            d.connect(bogus, timeout=0.2)
        addr = PrefillAddress("P", *p.address)
        t0 = time.monotonic()
        rp, rd = push_ok(p, d, addr, "real")
        assert rp.ok and rd.ok, (rp, rd)
        assert time.monotonic() - t0 < 3.0
    finally:
        d.close()
        p.close()
