"""docs/architecture.md's reading path is what the code does: one request's calls from `prefill_done` to
the NIXL post, traced on the engine's and the push thread's own stacks (sys.setprofile on each), hold every
stop the page lists, in its order; the page lists at most 10 stops in at most 10 files."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from tests.endpoint.test_armed_nixl import N, Pair, fill_src, pair, results, until  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def documented_stops() -> list[tuple[str, str]]:
    """(file under kvpush/, qualified name) of each numbered stop of the reading path."""
    text = DOC.read_text()
    section = text[text.index("### Reading path") :]
    section = section[: section.index("\n#", 1)] if "\n#" in section[1:] else section
    stops = re.findall(r"^\d+\. `([^`]+\.py)` `([\w.]+)`", section, re.M)
    assert stops, "docs/architecture.md: no numbered stops under 'Reading path'"
    return stops


class Trace:
    """Every Python call into kvpush's tree, on the threads it is installed on, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.prefix = str(ROOT / "kvpush") + "/"

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(self.prefix):
            with self.lock:
                self.calls.append((path[len(self.prefix) :], frame.f_code.co_qualname))


@pytest.mark.parametrize("pair", [{"post_workers": 0}], indirect=True)
def test_the_documented_reading_path_is_the_path_one_request_takes(pair: Pair) -> None:  # noqa: F811
    stops = documented_stops()
    assert len(stops) <= 10, f"{len(stops)} stops: {stops}"
    assert len({f for f, _ in stops}) <= 10, sorted({f for f, _ in stops})

    src, dst = [3, 4, 5], [7, 8]
    fill_src(pair, src, 5)
    pair.de.expect("walk", dst, N, pair.addr)
    until(lambda: len(pair.pe._push.state))  # the registration is there: prefill_done triggers the WRITE
    trace = Trace()
    pair.pe._loop.call(lambda: sys.setprofile(trace), timeout=10)
    sys.setprofile(trace)
    try:
        pair.pe.prefill_done("walk", src, N)
    finally:
        sys.setprofile(None)
    sent = results(pair.pe, "walk")
    pair.pe._loop.call(lambda: sys.setprofile(None), timeout=10)
    assert sent.ok, sent.reason
    assert results(pair.de, "walk").ok

    with trace.lock:
        calls = list(trace.calls)
    first = {}
    for i, call in enumerate(calls):
        first.setdefault(call, i)
    at = []
    for path, name in stops:
        assert (path, name) in first, f"stop {path} {name} is not a call this request made"
        at.append(first[(path, name)])
    assert at == sorted(at), f"the stops came in another order: {sorted(zip(at, stops, strict=True))}"
    assert stops[-1][0].startswith("transport/"), "the path ends at the transport's post"
