"""kvpush for vLLM: the KV connector, the concurrent-dispatch proxy, serve-pd and bench-vllm.

vLLM loads the connector with `kv_connector_module_path: "kvpush.platforms.vllm"`, which imports this
package and reads `KVPushConnector`. The attribute is resolved lazily so that importing the package (for
the proxy, say) does not import torch or vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPushConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPushConnector":
        from .connector import KVPushConnector

        return KVPushConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
