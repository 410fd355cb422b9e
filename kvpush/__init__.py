"""kvpush: push-based KV-cache transfer between prefill and decode engines over NIXL.

The public surface. The protocol core (kvpush.protocol) is sans-IO and importable without torch, vLLM or
NIXL; kvpush.endpoint wires it to one transfer thread per rank, a side channel and a transport.

    from kvpush import DecodeEndpoint, KVLayout, KVPushConfig, PrefillAddress, PrefillEndpoint

MemoryHub/MemoryTransport (the data plane) and MemoryControl (the side channel) run both endpoints in one
process with no NIXL and no sockets: the base install's first contact (README) and the tests' transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import *  # noqa: F403 - the error tree, named once: errors.__all__

if TYPE_CHECKING:
    from .config import KVPushConfig
    from .endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint, RecvResult, SendResult
    from .endpoint.control import MemoryControl
    from .protocol.layout import KVLayout, Plane, Region, packed_planes
    from .protocol.reasons import Failure
    from .transport.memory import MemoryHub, MemoryTransport

# Resolved on first use, so that `import kvpush.protocol.sender` (or the proxy) does not pull in the
# endpoints' ZeroMQ and NIXL layers. (The errors import nothing: they are bound above.)
_WHERE = {
    "KVPushConfig": ".config",
    **dict.fromkeys(
        ("DecodeEndpoint", "PrefillAddress", "PrefillEndpoint", "RecvResult", "SendResult"), ".endpoint"
    ),
    **dict.fromkeys(("KVLayout", "Plane", "Region", "packed_planes"), ".protocol.layout"),
    "Failure": ".protocol.reasons",
    # in-process stand-ins for NIXL and the side channel (tests, first contact; same contract)
    "MemoryControl": ".endpoint.control",
    **dict.fromkeys(("MemoryHub", "MemoryTransport"), ".transport.memory"),
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kvpush' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


__version__ = "0.2.0"

__all__ = [
    "DecodeEndpoint",
    "Failure",
    "KVLayout",
    "KVPushConfig",
    "MemoryControl",
    "MemoryHub",
    "MemoryTransport",
    "Plane",
    "PrefillAddress",
    "PrefillEndpoint",
    "RecvResult",
    "Region",
    "SendResult",
    "__version__",
    "packed_planes",
]
__all__ += errors.__all__
