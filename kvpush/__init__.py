"""kvpush: push-based KV-cache transfer between prefill and decode engines over NIXL.

The core (wire, layout, plan, sender, receiver) is sans-IO and importable without torch, vLLM or NIXL;
`kvpush.api` wires it to real threads, sockets and a NIXL agent.
"""

__version__ = "0.1.0"
