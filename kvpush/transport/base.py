"""The transport contract: what the runtime needs from a data plane, and nothing more.

One owner thread drives a transport; it posts one-sided transfers with a notification, polls them to
completion, sends standalone notifications and drains received ones. Backend exceptions are translated
once, here at the boundary, into TransportError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import TransportError as TransportError  # re-exported: the data plane's error
from ..protocol.layout import Region

XferState = Literal["DONE", "PROC"]
Descs = npt.NDArray[np.int64]  # N x 3: (addr, len, device id)


class XferHandle(Protocol):
    """Opaque handle of a posted transfer."""


class Transport(Protocol):
    name: str

    def register(self, regions: Sequence[Region], mem_type: str) -> None: ...
    def metadata(self) -> bytes: ...
    def add_peer(self, metadata: bytes) -> str: ...
    def connect(self, peer: str) -> None: ...
    def remove_peer(self, peer: str) -> None: ...
    def post_write(
        self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str
    ) -> XferHandle: ...
    def poll(self, handle: XferHandle) -> XferState: ...
    def release(self, handle: XferHandle) -> None: ...
    def send_notif(self, peer: str, msg: bytes) -> None: ...
    def drain_notifs(self) -> list[tuple[str, bytes]]: ...
    def close(self) -> None: ...
