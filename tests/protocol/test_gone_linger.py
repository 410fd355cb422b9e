"""Found by `kvpush soak`: the decode freed a request's blocks the moment its prefill was proven gone
(killed, and a new instance answered), but bytes the dead process had already sent still landed: over
TCP, UCX emulates a PUT and the *receiver's* progress writes them. A freed block then held stale bytes
(1-8 MB per run of 60 requests). Proven gone now returns the blocks gone_linger_s (write_linger_s) later."""

from __future__ import annotations

from kvpush.protocol.receiver import Failed, ReceiverState


def test_blocks_of_a_gone_prefill_come_back_only_after_the_linger():
    r = ReceiverState("D", 0, 1, 1, 3.0, 1.2, gone_linger_s=0.3)
    r.expect("a", (1, 2), 8, 1, 0.0)
    assert not [a for a in r.on_peer_gone(0, "it restarted", 1.0) if isinstance(a, Failed)]
    assert not [a for a in r.on_tick(1.29) if isinstance(a, Failed)]
    assert r.tracks("a")
    got = [a for a in r.on_tick(1.3) if isinstance(a, Failed)]
    assert [g.block_ids for g in got] == [(1, 2)] and "gone" in got[0].reason
    assert not r.tracks("a")


def test_a_done_before_the_linger_ends_is_ignored_and_the_request_still_fails_once():
    r = ReceiverState("D", 0, 1, 1, 3.0, 1.2, gone_linger_s=0.3)
    r.expect("a", (1,), 4, 1, 0.0)
    r.on_peer_gone(0, "agent gone", 1.0)
    out = r.on_peer_gone(0, "agent gone", 1.1) + r.on_tick(1.2)
    assert not [a for a in out if isinstance(a, Failed)]
    assert len([a for a in r.on_tick(1.31) if isinstance(a, Failed)]) == 1
    assert not r.on_tick(5.0)
