"""kvpush: push-based KV-cache transfer between prefill and decode engines over NIXL.

The public surface. The protocol core (kvpush.protocol) is sans-IO and importable without torch, vLLM or
NIXL; kvpush.endpoint wires it to one transfer thread per rank, a side channel and a transport.

    from kvpush import DecodeEndpoint, KVLayout, KVPushConfig, PrefillAddress, PrefillEndpoint
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import *  # noqa: F403 - the error tree, named once: errors.__all__

if TYPE_CHECKING:
    from .config import KVPushConfig
    from .endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint, RecvResult, SendResult
    from .protocol.layout import KVLayout, Plane, Region, packed_planes
    from .protocol.reasons import Failure

# Resolved on first use, so that `import kvpush.protocol.sender` (or the proxy) does not pull in the
# endpoints' ZeroMQ and NIXL layers. (The errors import nothing: they are bound above.)
_WHERE = {
    "KVPushConfig": ".config",
    **dict.fromkeys(
        ("DecodeEndpoint", "PrefillAddress", "PrefillEndpoint", "RecvResult", "SendResult"), ".endpoint"
    ),
    **dict.fromkeys(("KVLayout", "Plane", "Region", "packed_planes"), ".protocol.layout"),
    "Failure": ".protocol.reasons",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'kvpush' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "DecodeEndpoint",
    "Failure",
    "KVLayout",
    "KVPushConfig",
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
