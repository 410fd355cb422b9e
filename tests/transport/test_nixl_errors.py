"""NIXL's exceptions are translated in one place (nixl_errors): a disconnected peer is PeerGone."""

from __future__ import annotations

import pytest

from kvpush.errors import PeerGone, TransportError
from kvpush.transport.nixl import nixl_errors


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
