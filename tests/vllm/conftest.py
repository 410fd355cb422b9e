"""Fixtures the real-vLLM test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.platforms.vllm.tools.serve_pd import Deployment
from tests.vllm.reference import SharedReference


@pytest.fixture(scope="session")
def fast_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedReference]:
    """The session's reference engine of the fast tiny model (tests/vllm/reference.py): call .get()."""
    shared = SharedReference(tmp_path_factory.mktemp("fast-reference"))
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def single(pd: Deployment, fast_reference: SharedReference) -> Deployment:
    """The reference for a module whose `pd` pair serves the fast tiny model; asked for after that pair is
    up, so the two start-ups do not fight for the 2 cores."""
    return fast_reference.get()
