"""What the bench's engine loops and their connectors share: the modes, a request as an engine sees it,
the engine state a connector may use, and the two connector interfaces (one strategy per mode)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpush.apps.bench.costmodel import CostModel
from kvpush.apps.blocks import BlockPool
from kvpush.protocol.layout import KVLayout

PUSH, PULL, PULL_THREADED = "push", "pull", "pull-threaded"
MODES = (PUSH, PULL, PULL_THREADED)


@dataclass
class Req:
    id: str
    prompt_len: int
    output_len: int
    arrival: float
    kv_params: dict[str, Any] | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # prefill: prompt tokens computed
    tokens: list[float] = field(default_factory=list)  # decode: token timestamps
    stats: dict[str, Any] = field(default_factory=dict)


def sleep_until(t: float) -> None:
    while True:
        d = t - time.monotonic()
        if d <= 0:
            return
        time.sleep(d)


class PrefillSide(Protocol):
    """The prefill engine's state a connector reads and changes."""

    layout: KVLayout
    port: int
    pool: BlockPool
    held: dict[str, Req]  # finished prefill, blocks kept until sent / read
    outbox: Any  # to the router
    acct: Any  # emulation-only side channel to the decode: (request id, source blocks)
    stop: threading.Event


class DecodeSide(Protocol):
    """The decode engine's state a connector reads."""

    cm: CostModel
    layout: KVLayout
    prefill_info: dict[str, Any]
    waiting_kv: dict[str, Req]  # allocated, KV not ready (WAITING_FOR_REMOTE_KVS)
    acct: Any


class PrefillConnector(Protocol):
    def start(self) -> dict[str, Any]:
        """Bring the connector up; what the decode needs to reach it (engine_id, host, port)."""
        ...

    def poll_freed(self) -> None:
        """vLLM: get_finished() each step -> finished_sending -> blocks freed."""
        ...

    def on_prefill_done(self, r: Req) -> None:
        """The step `r`'s prompt finished: hand its blocks over and tell the router."""
        ...

    def close(self) -> None: ...


class DecodeConnector(Protocol):
    loop_charged_s: float  # engine-loop time spent posting (pull without a reader thread)

    def start(self) -> None: ...
    def on_alloc(self, r: Req) -> None:
        """vLLM update_state_after_alloc: `r` has its blocks."""
        ...

    def start_load_kv(self) -> None:
        """vLLM start_load_kv, inside the engine step."""
        ...

    def get_finished(self) -> Sequence[str]:
        """vLLM get_finished, each step: the requests whose KV is usable now (or failed)."""
        ...

    def close(self) -> None: ...
