"""NIXL's exceptions are translated in one place (nixl_errors, and `translated` on the per-WRITE calls): a
disconnected peer is PeerGone."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.errors import PeerGone, TransportError
from kvpush.transport.nixl import NixlTransport, nixl_errors


class nixlRemoteDisconnectError(RuntimeError):
    pass


class nixlInvalidParamError(RuntimeError):
    pass


def test_a_remote_disconnect_becomes_peer_gone_with_what_failed():
    want = "NIXL notification to 'd0' failed: agent d0 disconnected"
    with pytest.raises(PeerGone, match=want) as info, nixl_errors("NIXL notification to 'd0' failed"):
        raise nixlRemoteDisconnectError("agent d0 disconnected")
    assert isinstance(info.value.__cause__, nixlRemoteDisconnectError)


def test_other_nixl_errors_become_transport_errors_and_ours_pass_through():
    with (
        pytest.raises(TransportError, match="could not register: bad address") as info,
        nixl_errors("could not register"),
    ):
        raise nixlInvalidParamError("bad address")
    assert not isinstance(info.value, PeerGone)
    mine = TransportError("already ours")
    with pytest.raises(TransportError) as again, nixl_errors("wrapping"):
        raise mine
    assert again.value is mine


class _FailingAgent:
    """An agent whose per-WRITE calls raise what it is given."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def make_prepped_xfer(self, *a, **k):
        raise self.exc

    transfer = check_xfer_state = release_xfer_handle = make_prepped_xfer


@pytest.mark.parametrize(
    "call, what",
    [
        (lambda t: t.make_write(None, np.zeros(3, np.int32), None, None, b""), "could not make a WRITE of 3"),
        (lambda t: t.repost(object()), "WRITE failed to post"),
        (lambda t: t.poll(object()), "transfer failed"),
        (lambda t: t.release(object()), "could not release a transfer handle"),
    ],
)
def test_the_per_write_calls_translate_as_nixl_errors_does(call, what):
    """make, post, poll and release catch by hand (no context manager per WRITE): same mapping."""
    t = NixlTransport.__new__(NixlTransport)  # only the agent: no NIXL needed
    t._agent = _FailingAgent(nixlRemoteDisconnectError("agent d0 disconnected"))
    with pytest.raises(PeerGone, match=f"{what}.*: agent d0 disconnected") as info:
        call(t)
    assert isinstance(info.value.__cause__, nixlRemoteDisconnectError)
    t._agent = _FailingAgent(nixlInvalidParamError("bad index"))
    with pytest.raises(TransportError, match="bad index") as other:
        call(t)
    assert not isinstance(other.value, PeerGone)
    mine = TransportError("already ours")
    t._agent = _FailingAgent(mine)
    with pytest.raises(TransportError) as again:
        call(t)
    assert again.value is mine
