"""Fixtures the real-vLLM test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.reference import SharedReference


@pytest.fixture(scope="session")
def fast_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedReference]:
    """The session's reference engine of the fast tiny model (tests/vllm/reference.py): call .get()."""
    shared = SharedReference(tmp_path_factory.mktemp("fast-reference"))
    yield shared
    shared.stop()
