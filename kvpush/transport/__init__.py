"""Transports: the data plane under the protocol (NIXL for real, in-memory for fault injection)."""

from .base import Transport, TransportError, XferHandle

__all__ = ["Transport", "TransportError", "XferHandle"]
