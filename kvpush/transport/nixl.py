"""NIXL transport: one nixl_agent, progress thread off, STRICT thread sync.

The owner thread polls (check_xfer_state / get_new_notifs) instead of NIXL's progress thread, whose
Python wrapper hard-codes a zero delay and would spin a core per agent. UCX is kept on loopback for
local runs (UCX_NET_DEVICES=lo) only when configured (ucx_net_devices) or set in the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import PeerGone
from ..protocol.layout import Region
from .base import Descs, Indices, Rows, TransportError, XferState, expand_rows

log = logging.getLogger("kvpush")


def prepare_environment(ucx_net_devices: str | None) -> None:
    """Set UCX/NIXL environment before the first agent is created (they are read at init)."""
    if ucx_net_devices:
        os.environ.setdefault("UCX_NET_DEVICES", ucx_net_devices)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


BACKENDS_ENV = "KVPUSH_BACKENDS"


def selected_backends(configured: Sequence[str], environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The NIXL backends to create: KVPUSH_BACKENDS (comma-separated, e.g. "LIBFABRIC") overrides the
    configured list, so one deployment file serves an EFA cluster and a single test host."""
    env = os.environ if environ is None else environ
    raw = env.get(BACKENDS_ENV, "").strip()
    chosen = tuple(b.strip().upper() for b in raw.split(",") if b.strip()) if raw else tuple(configured)
    if not chosen:
        raise TransportError(f"no NIXL backend selected (config backends and {BACKENDS_ENV} are empty)")
    return chosen


def check_backend(agent: Any, backend: str, mem_types: Sequence[str]) -> None:
    """Refuse an agent that lacks `backend` or one of `mem_types` on it, naming what is missing.

    NIXL's Python wrapper only logs a warning when a requested plugin is missing and the agent comes up
    without it; with LIBFABRIC that would surface much later as a registration or transfer failure, or,
    for Neuron memory, not at all (the plugin lists VRAM only when it found Neuron devices).
    """
    plugins = list(agent.get_plugin_list())
    if backend not in plugins:
        raise TransportError(
            f"NIXL backend {backend!r} did not load: its plugin is not among the loadable plugins "
            f"{sorted(plugins)}.{load_hint(backend)}"
        )
    if backend not in getattr(agent, "backends", {}):
        raise TransportError(f"NIXL backend {backend!r} was not instantiated by the agent")
    have = [str(m) for m in agent.get_backend_mem_types(backend)]
    missing = [m for m in mem_types if _seg(m) not in {_seg(h) for h in have}]
    if missing:
        hint = ""
        if backend == "LIBFABRIC" and "VRAM" in missing:
            hint = (
                " LIBFABRIC lists VRAM only when it finds CUDA GPUs or Neuron devices (and, for Neuron, "
                "an initialised Neuron runtime before the NIXL agent is created); otherwise device memory "
                "would be registered as host memory."
            )
        raise TransportError(f"NIXL backend {backend!r} supports memory types {have}, not {missing}.{hint}")


def load_hint(backend: str) -> str:
    """What a backend needs to load, for error messages (empty where there is nothing specific)."""
    if backend == "LIBFABRIC":
        return (
            " The LIBFABRIC plugin needs libfabric >= 1.21 (on EFA: the AWS EFA installer's) and "
            "libcuda.so.1 (a stub is enough on Neuron) resolvable by the loader, and NIXL >= 0.10 for "
            "Neuron memory; NIXL reports NIXL_ERR_NOT_FOUND / 'unsupported backend' otherwise."
        )
    return ""


# NIXL's typed exceptions (nixl._bindings) that mean the remote agent is gone, by class name, so this
# module imports without NIXL installed.
_PEER_GONE_ERRORS = frozenset({"nixlRemoteDisconnectError"})


@contextlib.contextmanager
def nixl_errors(what: str) -> Iterator[None]:
    """The one place NIXL's exceptions become kvpush's (with `translated`, its by-hand form on the
    per-WRITE calls): `PeerGone` for a disconnected remote agent, `TransportError` for everything else,
    each with `what` failed and NIXL's own message."""
    try:
        yield
    except TransportError:
        raise
    except Exception as exc:
        raise translated(exc, what) from exc


def translated(exc: Exception, what: str) -> TransportError:
    """nixl_errors' mapping, for the per-WRITE calls that catch by hand (a generator-based context
    manager and its message cost microseconds on every WRITE, none of which an error-free call needs)."""
    kind = PeerGone if type(exc).__name__ in _PEER_GONE_ERRORS else TransportError
    return kind(f"{what}: {exc}")


def strided_lists_supported(agent: Any) -> bool:
    """Whether this NIXL accepts N x 5 strided rows in prep_xfer_dlist, by trying one.

    NIXL >= 1.5 prepares a strided row as `count` descriptors; 1.3.x's wrapper sends every list through
    get_xfer_descs, which takes N x 3 only, logs "Nx3 shape required" and hands None on, so the binding
    raises TypeError. A feature probe instead of a version string: a build with the feature back-ported
    (or removed) is told apart by what it does. The probe registers 64 bytes of host memory, prepares a
    one-row strided list over it and releases both; any failure other than success counts as "no" (the
    expanded form works everywhere, it only costs descriptors).
    """
    buf = np.zeros(64, dtype=np.uint8)
    # 1.3.x's wrapper logs the refusal at ERROR through its module logger: silenced for the probe only
    quiet = getattr(sys.modules.get(type(agent).__module__), "logger", None)
    was = quiet.disabled if isinstance(quiet, logging.Logger) else None
    if isinstance(quiet, logging.Logger):
        quiet.disabled = True
    try:
        return _try_strided_row(agent, buf)
    finally:
        if isinstance(quiet, logging.Logger) and was is not None:
            quiet.disabled = was


def _try_strided_row(agent: Any, buf: np.ndarray[Any, Any]) -> bool:
    try:
        reg = agent.register_memory([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")
    except Exception:  # noqa: BLE001 - any NIXL error: a backend without host memory, the safe answer
        return False
    try:
        row = np.array([[int(buf.ctypes.data), 16, 0, 16, 4]], dtype=np.int64)
        handle = agent.prep_xfer_dlist("NIXL_INIT_AGENT", row, "DRAM")
    except Exception:  # noqa: BLE001 - 1.3.x raises TypeError; any other refusal means "no" as well
        return False
    else:
        with contextlib.suppress(Exception):
            agent.release_dlist_handle(handle)
        return True
    finally:
        with contextlib.suppress(Exception):
            agent.deregister_memory(reg)


def _seg(mem_type: str) -> str:
    """'VRAM' and 'VRAM_SEG' name the same memory type (the bindings report the _SEG form)."""
    return mem_type.upper().removesuffix("_SEG")


def _param_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# After a standalone notification the owner thread keeps progressing the agent this long, even with
# nothing in flight: NIXL 1.3.2 held such a notice until both sides had progressed some 27 ms (one
# progress call was not enough) and UCX cancelled it at close otherwise ("UCX AM send failed ... Request
# canceled"); 1.5.1 sent the same notice in 0.4 ms. Bounded, as no handle says when it has left.
NOTIF_PROGRESS_S = 10.0


class NixlTransport:
    _progress_until = 0.0  # monotonic time until which progress_owed() is True (send_notif sets it)

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        backend_params: Mapping[str, Mapping[str, object]] | None = None,
        mem_types: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """Create the agent with exactly the backends asked for, or raise TransportError naming the one
        that did not load or lacks a memory type in `mem_types` (what the caller will register).

        backends: overridden by KVPUSH_BACKENDS (see `selected_backends`). backend_params: init
        parameters per backend, e.g. {"LIBFABRIC": {"num_threads": 4, "striping_threshold": 131072}};
        values are passed to NIXL as strings.
        """
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise TransportError(
                f"NIXL is not importable ({exc}); install kvpush's nixl extra: pip install -e '.[nixl]' "
                "in a kvpush checkout (1.5.1 and 1.3.2 are tested; `kvpush doctor` names the command "
                "for this install)"
            ) from exc
        chosen = selected_backends(backends, environ)
        params = backend_params or {}
        unknown = sorted(set(params) - set(chosen))
        if unknown:
            raise TransportError(
                f"backend_params name backends {unknown} that are not selected {list(chosen)}"
            )
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],  # created one by one below, so a missing plugin is an error, not a warning
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        with nixl_errors(f"could not create NIXL agent {name!r} with backends {list(chosen)}"):
            self._agent: Any = nixl_agent(name, config)
        for backend in chosen:
            if backend not in self._agent.get_plugin_list():
                check_backend(self._agent, backend, mem_types)  # raises, naming the missing plugin
            init = {str(k): _param_text(v) for k, v in params.get(backend, {}).items()}
            try:
                self._agent.create_backend(backend, init)
            except Exception as exc:
                raise TransportError(
                    f"NIXL backend {backend!r} failed to initialise with parameters {init}: {exc}."
                    f"{load_hint(backend)}"
                ) from exc
            check_backend(self._agent, backend, mem_types)
        self.backends = chosen
        self.name = name
        self.strided_lists = strided_lists_supported(self._agent)
        if not self.strided_lists:
            log.warning(
                "kvpush: NIXL agent %s takes no strided descriptor lists (NIXL < 1.5): prepared lists are "
                "expanded to one descriptor per unit (block or block x head, per plane)",
                name,
            )
        self._registered: list[Any] = []
        self._tls = threading.local()

    def register(self, regions: Sequence[Region], mem_type: str) -> None:
        descs = [(r.addr, r.nbytes, r.device_id, "") for r in regions]
        with nixl_errors(f"NIXL could not register {len(descs)} {mem_type} region(s)"):
            self._registered.append(self._agent.register_memory(descs, mem_type))

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        with nixl_errors("NIXL refused a peer's metadata"):
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, peer: str) -> None:
        """Open the connection now, so the first request does not pay for it."""
        with nixl_errors(f"NIXL could not connect to {peer!r}"):
            self._agent.make_connection(peer)

    def remove_peer(self, peer: str) -> None:
        with nixl_errors(f"NIXL could not remove peer {peer!r}"):
            self._agent.remove_remote_agent(peer)

    def _post(self, op: str, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> Any:
        with nixl_errors(f"NIXL {op} to {peer!r} ({local.shape[0]} descriptors) failed to post"):
            ldl = self._agent.get_xfer_descs(local, mem_type)
            rdl = self._agent.get_xfer_descs(remote, mem_type)
            handle = self._agent.initialize_xfer(op, ldl, rdl, peer, notif)
            state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"NIXL {op} to {peer!r} returned ERR when posted")
        return handle

    def post_write(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> Any:
        return self._post("WRITE", peer, local, remote, notif, mem_type)

    # ---- prepared lists: prepared once per peer, then one make_prepped_xfer per request --------------
    def prepare(self, peer: str | None, rows: Rows, mem_type: str) -> Any:
        """prep_xfer_dlist over N x 3 or N x 5 (strided) rows; the strided form keeps a whole plane of a
        large cache in one row instead of one descriptor per block. Where this NIXL takes no strided
        lists, strided rows are expanded first (the same descriptors, in the same index order)."""
        who = "NIXL_INIT_AGENT" if peer is None else peer
        if not self.strided_lists and rows.shape[1] == 5:
            rows = expand_rows(rows)
        with nixl_errors(
            f"NIXL could not prepare a {rows.shape[0]}-row descriptor list for "
            f"{'local memory' if peer is None else repr(peer)}"
        ):
            return self._agent.prep_xfer_dlist(who, rows, mem_type)

    def make_write(
        self, local: Any, local_idx: Indices, remote: Any, remote_idx: Indices, notif: bytes
    ) -> Any:
        try:
            return self._agent.make_prepped_xfer(
                "WRITE", local, local_idx, remote, remote_idx, notif_msg=notif
            )
        except TransportError:
            raise
        except Exception as exc:
            raise translated(exc, f"NIXL could not make a WRITE of {local_idx.shape[0]} indices") from exc

    def repost(self, handle: Any, notif: bytes | None = None) -> None:
        try:
            state = self._agent.transfer(handle) if notif is None else self._agent.transfer(handle, notif)
        except TransportError:
            raise
        except Exception as exc:
            raise translated(exc, "NIXL WRITE failed to post") from exc
        if state == "ERR":
            raise TransportError("NIXL WRITE returned ERR when posted")

    def post_prepared(
        self, local: Any, local_idx: Indices, remote: Any, remote_idx: Indices, notif: bytes
    ) -> Any:
        handle = self.make_write(local, local_idx, remote, remote_idx, notif)
        self._tls.made_at = time.monotonic()
        try:
            self.repost(handle)
        except TransportError:
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)
            raise
        return handle

    def made_at(self) -> float | None:
        """When this thread's last post_prepared had made its transfer and began posting it (the
        per-request timeline's `made`: on UCX loopback the copy runs inside the post that follows)."""
        got: float | None = getattr(self._tls, "made_at", None)
        return got

    def release_prepared(self, plist: Any) -> None:
        with nixl_errors("NIXL could not release a prepared descriptor list"):
            self._agent.release_dlist_handle(plist)

    def poll(self, handle: Any) -> XferState:
        try:
            state = self._agent.check_xfer_state(handle)
        except TransportError:
            raise
        except Exception as exc:
            raise translated(exc, "NIXL transfer failed") from exc
        if state == "ERR":
            raise TransportError("NIXL transfer ended in ERR (peer gone or memory invalid)")
        return "DONE" if state == "DONE" else "PROC"

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except TransportError:
            raise
        except Exception as exc:
            raise translated(exc, "NIXL could not release a transfer handle") from exc

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Hand a notification to NIXL, which gives it to UCX untracked: nothing says when it has left.
        On 1.3.x the first message on a connection waits for both sides to progress (a handshake), so
        the owner thread is owed NOTIF_PROGRESS_S of progress after it (progress_owed)."""
        with nixl_errors(f"NIXL notification to {peer!r} failed"):
            self._agent.send_notif(peer, msg)
        self._progress_until = time.monotonic() + NOTIF_PROGRESS_S

    def progress_owed(self, now: float) -> bool:
        return now < self._progress_until

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        with nixl_errors("NIXL could not read notifications"):
            got = self._agent.get_new_notifs()
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
