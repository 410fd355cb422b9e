"""One error tree for everything kvpush raises.

Catch `KVPushError` to catch them all. The builtin bases (ValueError, RuntimeError, TimeoutError) are kept
where a caller written against the standard library would reasonably expect them, so existing
`except ValueError` code keeps working; new code should catch the kvpush classes.

    KVPushError
    ├── ConfigError              a setting is missing, unknown or out of range
    ├── LayoutError              a layout is malformed, or two layouts cannot exchange KV
    ├── RequestError             an engine-facing call got bad arguments (empty id, no tokens)
    ├── ProtocolError
    │   ├── LocalProtocolError   our own state machine was driven into a transition it does not allow
    │   └── RemoteProtocolError  a peer sent something we cannot accept (WireError) or refused us (PeerRefused)
    ├── TransportError           the data plane failed (NIXL, memory)
    │   ├── PeerGone             the remote agent disconnected or died
    │   └── HandshakeTimeout     a peer did not answer the handshake in time
    ├── EndpointTimeout          the transfer thread did not answer a call in time
    └── EndpointClosed           the endpoint was closed or its thread died; `__cause__` says why
"""

from __future__ import annotations


class KVPushError(Exception):
    """Root of every error kvpush raises on purpose."""


class ConfigError(KVPushError, ValueError):
    """A configuration value is missing, unknown or out of range."""


class LayoutError(KVPushError, ValueError):
    """Two layouts cannot exchange KV, or one is malformed."""


class RequestError(KVPushError, ValueError):
    """An engine-facing call was given arguments that can never work (the request is refused at once)."""


class ProtocolError(KVPushError):
    """The push protocol was violated, locally or by a peer."""


class LocalProtocolError(ProtocolError, RuntimeError):
    """An event reached a state machine in a state where its transition table does not allow it."""


class RemoteProtocolError(ProtocolError, ValueError):
    """A peer sent a message we refuse, or refused ours."""


class WireError(RemoteProtocolError):
    """A message could not be decoded; the text says why."""


class PeerRefused(RemoteProtocolError, LayoutError):
    """A peer refused the pairing in the handshake (a layout or role mismatch on its side)."""


class TransportError(KVPushError, RuntimeError):
    """A transfer, notification or peer operation failed; the message says which and why."""


class PeerGone(TransportError):
    """The remote agent is gone (disconnected, dead, or removed)."""


class HandshakeTimeout(TransportError, TimeoutError):
    """A peer did not answer the handshake within the configured time."""


class EndpointTimeout(KVPushError, TimeoutError):
    """The transfer thread did not answer a call (pending(), connect()) within the time given."""


class EndpointClosed(KVPushError, RuntimeError):
    """The endpoint was closed, or its transfer thread died (the cause is chained as __cause__)."""


__all__ = [
    "ConfigError",
    "EndpointClosed",
    "EndpointTimeout",
    "HandshakeTimeout",
    "KVPushError",
    "LayoutError",
    "LocalProtocolError",
    "PeerGone",
    "PeerRefused",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestError",
    "TransportError",
    "WireError",
]
