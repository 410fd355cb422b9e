"""The I/O edge: the only place in kvpush with threads (one transfer thread per endpoint)."""

from .base import PrefillAddress, RecvResult, SendResult
from .control import ControlPlane, MemoryControl, ZmqControl
from .decode import DecodeEndpoint
from .prefill import PrefillEndpoint

__all__ = [
    "ControlPlane",
    "DecodeEndpoint",
    "MemoryControl",
    "PrefillAddress",
    "PrefillEndpoint",
    "RecvResult",
    "SendResult",
    "ZmqControl",
]
