"""The transport contract: what the runtime needs from a data plane, and nothing more.

One owner thread drives a transport; it posts one-sided transfers with a notification, polls them to
completion, sends standalone notifications and drains received ones. Backend exceptions are translated
once, here at the boundary, into TransportError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..errors import TransportError as TransportError  # re-exported: the data plane's error
from ..protocol.layout import Region

XferState = Literal["DONE", "PROC"]
Descs = npt.NDArray[np.int64]  # N x 3: (addr, len, device id)
# N x 5 strided rows (addr, len, device id, stride, count): row r names `count` descriptors of `len` bytes,
# `stride` apart; a prepared list's descriptors are numbered row after row. N x 3 rows are count 1.
Rows = npt.NDArray[np.int64]
Indices = npt.NDArray[np.int32]


def expand_rows(rows: Rows) -> Descs:
    """N x 3 rows as they are; N x 5 strided rows expanded to one descriptor per (row, i < count)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] not in (3, 5):
        raise TransportError(f"a prepared list takes N x 3 or N x 5 rows, not shape {rows.shape}")
    if rows.shape[1] == 3:
        return rows
    counts = rows[:, 4]
    row_of = np.repeat(np.arange(rows.shape[0]), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    k = np.arange(row_of.shape[0], dtype=np.int64) - first
    addr = rows[row_of, 0] + k * rows[row_of, 3]
    return np.stack((addr, rows[row_of, 1], rows[row_of, 2]), axis=1)


def listed_descriptors(rows: Rows, strided: bool) -> int:
    """How many descriptors a prepared list of `rows` holds in the transport: one per row where strided
    rows are accepted as they are, else one per (row, i < count) after `expand_rows`."""
    rows = np.asarray(rows)
    if strided or rows.shape[1] == 3:
        return int(rows.shape[0])
    return int(rows[:, 4].sum())


class XferHandle(Protocol):
    """Opaque handle of a posted transfer."""


class PreparedList(Protocol):
    """Opaque handle of a descriptor list prepared once (per peer, at handshake) and then addressed by
    index, so a request costs index arrays instead of a fresh descriptor list."""


@runtime_checkable
class Transport(Protocol):
    name: str
    # Whether prepare() hands N x 5 strided rows to the data plane as they are (NIXL >= 1.5) or expands
    # them to one descriptor per unit first (NIXL 1.3.x accepts only N x 3); prepared indices are the same.
    strided_lists: bool

    def register(self, regions: Sequence[Region], mem_type: str) -> None: ...
    def metadata(self) -> bytes: ...
    def add_peer(self, metadata: bytes) -> str: ...
    def connect(self, peer: str) -> None: ...
    def remove_peer(self, peer: str) -> None: ...
    def post_write(
        self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str
    ) -> XferHandle: ...
    def prepare(self, peer: str | None, rows: Rows, mem_type: str) -> PreparedList:
        """Prepare a descriptor list: local memory when peer is None, else the peer's memory."""
        ...

    def make_write(
        self, local: PreparedList, local_idx: Indices, remote: PreparedList, remote_idx: Indices, notif: bytes
    ) -> XferHandle:
        """A WRITE of local descriptors local_idx[i] -> remote descriptors remote_idx[i], made but not posted.

        Runs of consecutive indices on both sides whose descriptors touch in memory go out as one
        descriptor (NIXL's makeXferReq merges them; MemoryTransport copies them either way)."""
        ...

    def repost(self, handle: XferHandle, notif: bytes | None = None) -> None:
        """Post a made (or completed) handle again, optionally with a new notification."""
        ...

    def post_prepared(
        self, local: PreparedList, local_idx: Indices, remote: PreparedList, remote_idx: Indices, notif: bytes
    ) -> XferHandle:
        """make_write + post: the per-request path."""
        ...

    def made_at(self) -> float | None:
        """When the calling thread's last post_prepared had made its transfer and began posting it
        (the timeline's `made`); None when the transport has no separate make step to time."""
        ...

    def release_prepared(self, plist: PreparedList) -> None: ...
    def poll(self, handle: XferHandle) -> XferState: ...
    def release(self, handle: XferHandle) -> None: ...
    def send_notif(self, peer: str, msg: bytes) -> None: ...
    def drain_notifs(self) -> list[tuple[str, bytes]]: ...
    def progress_owed(self, now: float) -> bool:
        """Whether the owner thread should keep calling drain_notifs (which progresses the data plane)
        though nothing of its own is in flight: a standalone notification may not have left yet. NIXL
        hands send_notif to UCX untracked, and on 1.3.x the first message on a connection waits for both
        sides to progress (docs/backends.md); a transport whose sends leave at once answers False."""
        ...

    def close(self) -> None: ...
