"""Shared by the endpoint tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(fn: Callable[[], list[Any]], timeout: float = 10.0) -> list[Any]:
    """Call fn (an endpoint's finished(), say) until it returns something; AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    got: list[Any] = []
    while time.monotonic() < deadline:
        got += fn()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("timed out")


def _nixl_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        return ""


# Streamed push (kv_ready ranges) on NIXL 1.3.x: the endpoint moves such requests in one piece (a
# notification sent after notification-less WRITEs was seen lost there: "UCX AM send failed ... Request
# canceled"; docs/contract.md), so the tests that assert ranges moving early run on NIXL >= 1.5 only.
NEEDS_STREAMING_NIXL = __import__("pytest").mark.skipif(
    _nixl_version().startswith("1.3."),
    reason="streamed ranges need NIXL >= 1.5 (on 1.3.x kvpush moves the request in one piece)",
)
