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
