"""The data plane both modes share: kvpush's NixlTransport, build_plan and HostKVCache.

While the core's transport is not importable (it is being written in parallel), a minimal stand-in with
the same contract (docs/contract.md) is used, built on the raw nixl agent API. Results record which one
ran (`transport_impl`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

try:  # the core's transport
    from kvpush.transport.nixl import NixlTransport  # type: ignore[import-not-found,unused-ignore]

    TRANSPORT_IMPL = "kvpush.transport.nixl"
except ImportError:  # pragma: no cover - only until the core lands
    NixlTransport = None  # type: ignore[assignment,misc]
    TRANSPORT_IMPL = "kvpush.bench.dataplane._StandInTransport"


class TransferFailed(RuntimeError):
    pass


class _StandInTransport:
    """Contract-compatible NIXL wrapper (progress thread off, STRICT sync)."""

    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        kw: dict[str, Any] = {"backends": list(backends), "enable_prog_thread": False}
        try:
            from nixl._bindings import nixl_thread_sync_t  # type: ignore[import-not-found]

            kw["sync_mode"] = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        except Exception:  # noqa: BLE001 - older wrappers without the knob
            pass
        try:
            cfg = nixl_agent_config(**kw)
        except TypeError:
            kw.pop("sync_mode", None)
            cfg = nixl_agent_config(**kw)
        self._agent = nixl_agent(name, cfg)
        self._dlists: dict[Any, tuple[Any, Any]] = {}

    def register(self, regions: Any, mem_type: str = "DRAM") -> None:
        self._agent.register_memory([(r.addr, r.nbytes, r.device_id, "") for r in regions], mem_type)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, md: bytes) -> str:
        name = self._agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def _post(self, op: str, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes,
              mem_type: str) -> Any:
        a = self._agent
        lp = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.ascontiguousarray(local, dtype=np.int64), mem_type)
        rp = a.prep_xfer_dlist(peer, np.ascontiguousarray(remote, dtype=np.int64), mem_type)
        idx = list(range(local.shape[0]))
        h = a.make_prepped_xfer(op, lp, idx, rp, idx, notif_msg=notif)
        state = a.transfer(h)
        if state == "ERR":
            raise TransferFailed(f"NIXL {op} to {peer} failed at post")
        self._dlists[h] = (lp, rp)
        return h

    def post_write(self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes,
                   mem_type: str = "DRAM") -> Any:
        return self._post("WRITE", peer, src, dst, notif, mem_type)

    def post_read(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes,
                  mem_type: str = "DRAM") -> Any:
        return self._post("READ", peer, local, remote, notif, mem_type)

    def poll(self, h: Any) -> str:
        state = self._agent.check_xfer_state(h)
        if state == "ERR":
            raise TransferFailed("NIXL transfer failed")
        return str(state)

    def release(self, h: Any) -> None:
        self._agent.release_xfer_handle(h)
        lp, rp = self._dlists.pop(h, (None, None))
        if lp is not None:
            self._agent.release_dlist_handle(lp)
            self._agent.release_dlist_handle(rp)

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._agent.send_notif(peer, msg)

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, msgs in self._agent.get_new_notifs().items():
            p = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((p, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        self._dlists.clear()


def make_transport(name: str) -> Any:
    if NixlTransport is not None:
        return NixlTransport(name)
    return _StandInTransport(name)


def wait_done(transport: Any, handle: Any, sleep_s: float = 20e-6, timeout_s: float = 30.0) -> float:
    """Drive a transfer to DONE (the emulated NIC's completion), return time.monotonic() at DONE."""
    deadline = time.monotonic() + timeout_s
    while transport.poll(handle) != "DONE":
        if time.monotonic() > deadline:
            raise TransferFailed("transfer did not complete in time")
        time.sleep(sleep_s)
    t = time.monotonic()
    transport.release(handle)
    return t
