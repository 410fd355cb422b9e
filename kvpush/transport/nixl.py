"""NIXL transport: one nixl_agent, progress thread off, STRICT thread sync.

The owner thread polls (check_xfer_state / get_new_notifs) instead of NIXL's progress thread, whose
Python wrapper hard-codes a zero delay and would spin a core per agent. UCX is kept on loopback for
local runs (UCX_NET_DEVICES=lo) unless configured otherwise.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any

from ..protocol.layout import Region
from .base import Descs, TransportError, XferState


def prepare_environment(ucx_net_devices: str | None) -> None:
    """Set UCX/NIXL environment before the first agent is created (they are read at init)."""
    if ucx_net_devices:
        os.environ.setdefault("UCX_NET_DEVICES", ucx_net_devices)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


class NixlTransport:
    def __init__(self, name: str, backends: Sequence[str] = ("UCX",)) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise TransportError(f"NIXL is not importable ({exc}); install nixl==1.5.1") from exc
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=list(backends),
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent: Any = nixl_agent(name, config)
        except Exception as exc:
            raise TransportError(
                f"could not create NIXL agent {name!r} with backends {list(backends)}: {exc}"
            ) from exc
        self.name = name
        self._registered: list[Any] = []
        self._lock = threading.Lock()

    def register(self, regions: Sequence[Region], mem_type: str) -> None:
        descs = [(r.addr, r.nbytes, r.device_id, "") for r in regions]
        try:
            self._registered.append(self._agent.register_memory(descs, mem_type))
        except Exception as exc:
            raise TransportError(f"NIXL could not register {len(descs)} {mem_type} region(s): {exc}") from exc

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"NIXL refused a peer's metadata: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, peer: str) -> None:
        """Open the connection now, so the first request does not pay for it."""
        try:
            self._agent.make_connection(peer)
        except Exception as exc:
            raise TransportError(f"NIXL could not connect to {peer!r}: {exc}") from exc

    def remove_peer(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:
            raise TransportError(f"NIXL could not remove peer {peer!r}: {exc}") from exc

    def _post(self, op: str, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> Any:
        try:
            ldl = self._agent.get_xfer_descs(local, mem_type)
            rdl = self._agent.get_xfer_descs(remote, mem_type)
            handle = self._agent.initialize_xfer(op, ldl, rdl, peer, notif)
            state = self._agent.transfer(handle)
        except Exception as exc:
            raise TransportError(
                f"NIXL {op} to {peer!r} ({local.shape[0]} descriptors) failed to post: {exc}"
            ) from exc
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"NIXL {op} to {peer!r} returned ERR when posted")
        return handle

    def post_write(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> Any:
        return self._post("WRITE", peer, local, remote, notif, mem_type)

    def poll(self, handle: Any) -> XferState:
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            raise TransportError(f"NIXL transfer failed: {exc}") from exc
        if state == "ERR":
            raise TransportError("NIXL transfer ended in ERR (peer gone or memory invalid)")
        return "DONE" if state == "DONE" else "PROC"

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            raise TransportError(f"NIXL could not release a transfer handle: {exc}") from exc

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:
            raise TransportError(f"NIXL notification to {peer!r} failed: {exc}") from exc

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        try:
            got = self._agent.get_new_notifs()
        except Exception as exc:
            raise TransportError(f"NIXL could not read notifications: {exc}") from exc
        out: list[tuple[str, bytes]] = []
        for peer, msgs in got.items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        for reg in self._registered:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
        self._registered.clear()
