"""Failure kinds travel with the actions: each way a request can fail names its kind, the same kind on
the decode's notification and on the released source, so metrics never read the reason text."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpush.protocol.handshake import Session
from kvpush.protocol.order import NOTIF, failure_notice
from kvpush.protocol.reasons import Failure, received
from kvpush.protocol.receiver import Failed, ReceiverState, SendRegistration
from kvpush.protocol.sender import NotifyFailure, ReleaseSource, SenderState, StartWrite
from kvpush.protocol.wire import Codec, Registration, TransferFailed


def reg(expires_at: float = 100.0, num_tokens: int = 8) -> Registration:
    return Registration(
        request_id="r",
        attempt=0,
        decode_engine_id="D",
        decode_rank=0,
        decode_tp=1,
        block_ids=[1, 2],
        num_tokens=num_tokens,
        expires_at=expires_at,
    )


def sender() -> SenderState:
    return SenderState(0, 1, 2, lease_s=10.0, tombstone_s=30.0)


def kinds(actions: list) -> list[tuple[str, Failure | None]]:
    return [(type(a).__name__, a.kind) for a in actions if isinstance(a, NotifyFailure | ReleaseSource)]


def test_a_lease_that_expires_is_expired():
    s = sender()
    s.on_prefill_done("r", (5, 6), 8, 0.0)
    assert kinds(s.on_tick(11.0)) == [("ReleaseSource", Failure.EXPIRED)]


def test_a_late_registration_is_expired():
    s = sender()
    assert kinds(s.on_registration(reg(expires_at=1.0), 2.0)) == [("NotifyFailure", Failure.EXPIRED)]


def test_an_engine_abort_is_aborted_on_both_actions():
    s = sender()
    s.on_registration(reg(), 0.0)
    assert kinds(s.abort("r", "engine said so", 1.0)) == [("NotifyFailure", Failure.ABORTED)]
    assert kinds(s.on_prefill_done("r", (5, 6), 8, 2.0)) == [("ReleaseSource", Failure.ABORTED)]


def test_a_token_mismatch_is_refused():
    s = sender()
    s.on_registration(reg(num_tokens=9), 0.0)
    got = kinds(s.on_prefill_done("r", (5, 6), 8, 1.0))
    assert got == [("NotifyFailure", Failure.REFUSED), ("ReleaseSource", Failure.REFUSED)]


def test_a_write_outcome_keeps_the_kind_the_edge_gave_it():
    for kind, abandoned in ((Failure.WRITE_FAILED, False), (Failure.TIMEOUT, True)):
        s = sender()
        s.on_registration(reg(), 0.0)
        (w,) = [a for a in s.on_prefill_done("r", (5, 6), 8, 1.0) if isinstance(a, StartWrite)]
        out = s.on_write_done("r", w.attempt, 0, False, 0, "boom", 2.0, abandoned, kind)
        assert kinds(out) == [("NotifyFailure", kind), ("ReleaseSource", kind)]


def receiver() -> ReceiverState:
    return ReceiverState("D", 0, 1, 2, ready_timeout_s=5.0, write_bound_s=1.0)


def failed_kind(actions: list) -> list[Failure]:
    return [a.kind for a in actions if isinstance(a, Failed)]


def test_the_receiver_names_timeouts_aborts_and_what_the_prefill_said():
    r = receiver()
    r.expect("r", (1, 2), 8, 1, 0.0)
    r.on_tick(5.0)  # the ready wait ran out; the blocks come back at the fence
    assert failed_kind(r.on_tick(7.0)) == [Failure.TIMEOUT]

    r = receiver()
    r.expect("r", (1, 2), 8, 1, 0.0)
    r.abort("r", "engine said so", 1.0)  # the prefill acknowledges with a failure: the kind stays
    ack = TransferFailed(
        request_id="r", attempt=0, prefill_rank=0, reason="aborted by decode rank 0", abandoned=False
    )
    assert failed_kind(r.on_failed(ack, 1.5)) == [Failure.ABORTED]

    for abandoned, kind in ((False, Failure.REMOTE), (True, Failure.TIMEOUT)):
        r = receiver()
        r.expect("r", (1, 2), 8, 1, 0.0)
        msg = TransferFailed(request_id="r", attempt=0, prefill_rank=0, reason="x", abandoned=abandoned)
        out = r.on_failed(msg, 1.0) + r.on_tick(7.0)
        assert failed_kind(out) == [kind]

    r = receiver()
    r.expect("r", (1, 2), 8, 1, 0.0)
    assert failed_kind(r.close("decode endpoint closed")) == [Failure.CLOSED]


# ---- the kind on the wire: what the prefill's machine says is what the decode's result says ----------
KEY = b"k" * 32


def _notice_through_the_wire(act: NotifyFailure) -> TransferFailed:
    """The prefill's NotifyFailure as its endpoint sends it (order.failure_notice: encoded and sealed) and
    as the decode's endpoint opens it."""
    codec = Codec()
    prefill = Session(codec, KEY, b"d" * 16, b"p" * 16, "prefill")
    decode = Session(codec, KEY, b"d" * 16, b"p" * 16, "decode")
    msg = decode.open(failure_notice(act, 0, prefill), NOTIF)
    assert isinstance(msg, TransferFailed)
    return msg


def _registered() -> tuple[ReceiverState, Registration]:
    """A decode rank expecting "r", and the registration it sends (through the wire, too)."""
    r = receiver()
    (send,) = [a for a in r.expect("r", (1, 2), 8, 1, 0.0) if isinstance(a, SendRegistration)]
    reg = Codec().decode(Codec().encode(send.message))
    assert isinstance(reg, Registration)
    return r, reg


def _write_fails(kind: Failure, abandoned: bool) -> Callable[[SenderState, Registration], list]:
    def run(s: SenderState, reg: Registration) -> list:
        s.on_registration(reg, 0.5)
        (w,) = [a for a in s.on_prefill_done("r", (5, 6), 8, 1.0) if isinstance(a, StartWrite)]
        return s.on_write_done("r", w.attempt, 0, False, 0, "boom", 2.0, abandoned, kind)

    return run


@pytest.mark.parametrize(
    "kind, fail",
    [
        (Failure.EXPIRED, lambda s, reg: s.on_registration(reg, 6.0)),  # it came after its expiry
        (Failure.REFUSED, lambda s, reg: s.on_registration(reg, 0.5) + s.on_prefill_done("r", (5,), 7, 1.0)),
        (Failure.ABORTED, lambda s, reg: s.on_registration(reg, 0.5) + s.abort("r", "engine said so", 1.0)),
        (Failure.WRITE_FAILED, _write_fails(Failure.WRITE_FAILED, False)),
        (Failure.TIMEOUT, _write_fails(Failure.TIMEOUT, True)),
        (Failure.PEER_GONE, _write_fails(Failure.PEER_GONE, False)),
    ],
)
def test_the_prefills_failure_kind_reaches_the_decodes_result_through_the_wire(kind, fail):
    """Before the kind travelled, every one of these ended as REMOTE on the decode (TIMEOUT if abandoned)."""
    r, reg = _registered()
    (act,) = [a for a in fail(sender(), reg) if isinstance(a, NotifyFailure)]
    assert act.kind is kind
    msg = _notice_through_the_wire(act)
    assert msg.kind is kind
    out = r.on_failed(msg, 2.5) + r.on_tick(20.0)  # an abandoned WRITE's blocks come back at the fence
    assert failed_kind(out) == [kind]


def test_a_prefill_that_closed_is_a_peer_gone_on_the_decode():
    """CLOSED on a result means this endpoint closed; the prefill's closing is its peer gone."""
    r, reg = _registered()
    s = sender()
    s.on_registration(reg, 0.5)
    (act,) = [
        a
        for a in s.abort("r", "prefill endpoint closed", 1.0, Failure.CLOSED)
        if isinstance(a, NotifyFailure)
    ]
    assert failed_kind(r.on_failed(_notice_through_the_wire(act), 2.0)) == [Failure.PEER_GONE]


def test_received_reads_an_old_peers_kindless_notice_as_before():
    assert received(Failure.REMOTE, abandoned=False) is Failure.REMOTE
    assert received(Failure.REMOTE, abandoned=True) is Failure.TIMEOUT
    assert received(Failure.CLOSED, abandoned=False) is Failure.PEER_GONE
    for kind in set(Failure) - {Failure.REMOTE, Failure.CLOSED}:
        assert received(kind, abandoned=False) is kind
