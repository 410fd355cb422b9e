"""Fixtures the real-vLLM test modules share, and the order that lets them share engines.

Shared engines (tests/vllm/shared_engines.py): the tests that use one run back to back (collection puts
every later user right after the first), it starts on first use and stops after its last user, so at most
one shared pair is up besides a module's own. After every test on the shared fast pair both engines must
be back at rest (no KV held, nothing running or waiting, no kvpush transfer outstanding): a test that leaks
fails there, by name, instead of the next test failing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvpush.platforms.vllm.tools.serve_pd import Deployment
from tests.vllm.reference import SharedReference
from tests.vllm.shared_engines import SharedEngines, at_rest_or_say_why, start_fast_pair, start_reference

# the shared engines' fixtures; each test using one of these is run next to the others that do
SHARED = ("fast_pair", "mla_reference")
_REGISTRY = pytest.StashKey[SharedEngines]()
_LAST_USER = pytest.StashKey[dict[str, str]]()


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


@pytest.fixture(scope="session")
def shared_engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedEngines]:
    engines = SharedEngines(tmp_path_factory.mktemp("shared-engines"))
    request.config.stash[_REGISTRY] = engines
    yield engines
    engines.stop_all()


@pytest.fixture(scope="module")
def fast_pair(shared_engines: SharedEngines) -> Deployment:
    """The shared kvpush pair of the fast tiny model behind the kvpush proxy (shared_engines.py)."""
    return shared_engines.get("fast_pair", start_fast_pair)


@pytest.fixture
def mla_reference(shared_engines: SharedEngines) -> Callable[[], Deployment]:
    """Gets the shared reference single engine of the tiny MLA model, configured as test_cache_kinds_vllm.py's
    MLA kind and test_mla_tp_vllm.py's TP 2 pair (both compare with it): called once the asker's own pair
    is up, so the start-ups do not fight for the 2 cores."""
    from tests.vllm.test_cache_kinds_vllm import MAX_MODEL_LEN, MLA_ENGINE_ARGS

    start = start_reference("mla", MAX_MODEL_LEN, MLA_ENGINE_ARGS)
    return lambda: shared_engines.get("mla_reference", start)


@pytest.fixture(autouse=True)
def _shared_pair_left_at_rest(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the shared fast pair: both engines back at rest, or the test fails here."""
    yield
    if "fast_pair" in request.fixturenames and not _failed(request):
        at_rest_or_say_why(request.getfixturevalue("fast_pair"))


def _failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "_kvpush_call_report", None)
    return report is not None and report.failed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when == "call":
        item._kvpush_call_report = outcome.get_result()  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each shared engine's users back to back, from where the first one was; remember the last one."""
    for name in SHARED:
        users = [item for item in items if name in getattr(item, "fixturenames", ())]
        if len(users) > 1:
            first = items.index(users[0])
            rest = [item for item in items[first:] if item not in users]
            items[first:] = users + rest
    config.stash[_LAST_USER] = {
        name: item.nodeid for item in items for name in SHARED if name in getattr(item, "fixturenames", ())
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop a shared engine once its last user is done (and its fixtures are torn down)."""
    yield
    engines = item.config.stash.get(_REGISTRY, None)
    if engines is None:
        return
    for name, nodeid in item.config.stash.get(_LAST_USER, {}).items():
        if nodeid == item.nodeid:
            engines.stop(name)
