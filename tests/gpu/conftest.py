"""tests/gpu: marked `gpu`, skipped where torch sees no CUDA device (every CPU box, CI included)."""

from __future__ import annotations

import pytest


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (scripts/gpu_check.sh runs these on one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(
        reason="no CUDA device visible (scripts/gpu_check.sh runs these on a GPU machine)"
    )
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
