"""The soak's run loop alone (no children, no NIXL): every scheduled fault kind must fire once per run even
when it finds no target at its one turn (CI once failed with "faults never injected: ['cross_peer']": on a
loaded box there were never two live requests with free decode blocks at cross_peer's turn)."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import pytest

from kvpush.apps.soak.driver import Soak


class LoopOnly(Soak):
    """Soak's run loop with the children, the relay and the report replaced by a script of which request
    index first gives each kind a target."""

    def __init__(self, n: int, schedule: dict[int, list[str]], ready_at: dict[str, int]) -> None:
        self.args = argparse.Namespace(requests=n, window=4)
        self.faults: Counter[str] = Counter()
        self.fixed = schedule
        self.ready_at = ready_at
        self.started = 0
        self.tries: list[tuple[int, str]] = []

    def _schedule(self, n: int) -> dict[int, list[str]]:
        return self.fixed

    def pump(self, timeout: float) -> None:
        pass

    def start_request(self, i: int) -> bool:
        self.started = i
        return True

    def inject(self, kind: str) -> bool:
        self.tries.append((self.started, kind))
        if self.started < self.ready_at.get(kind, 0):
            return False
        self.faults[kind] += 1
        return True

    def _drain(self) -> None:
        pass

    def _report(self, elapsed: float) -> dict[str, Any]:
        return dict(self.faults)

    @property
    def book(self) -> Any:
        return argparse.Namespace(live=list, t0=0.0)

    @property
    def kids(self) -> Any:
        return argparse.Namespace(start=lambda: None)


def test_a_kind_without_a_target_at_its_turn_is_tried_at_later_requests_until_it_fires() -> None:
    loop = LoopOnly(20, {3: ["cross_peer"]}, {"cross_peer": 9})
    assert loop.run() == {"cross_peer": 1}
    assert [i for i, k in loop.tries] == list(range(3, 10))  # tried at 3..9, fired at 9, then left alone


def test_extra_injections_of_a_kind_that_already_fired_are_not_retried() -> None:
    loop = LoopOnly(20, {2: ["abort_decode"], 5: ["abort_decode"]}, {"abort_decode": 0})
    loop.ready_at["abort_decode"] = 0
    assert loop.run() == {"abort_decode": 2}
    # a kind that fired once and finds no target later is dropped at that turn, not carried on
    late = LoopOnly(20, {2: ["resend"], 5: ["resend"]}, {})
    late.ready_at = {"resend": 0}
    late.inject = lambda kind, _l=late: _once(_l, kind)  # type: ignore[method-assign]
    assert late.run() == {"resend": 1}
    assert [i for i, k in late.tries] == [2, 5]


def _once(loop: LoopOnly, kind: str) -> bool:
    loop.tries.append((loop.started, kind))
    if loop.faults[kind]:
        return False
    loop.faults[kind] += 1
    return True


def test_a_kind_owed_and_due_again_is_tried_once_per_request() -> None:
    loop = LoopOnly(12, {1: ["cross_peer"], 4: ["cross_peer", "huge_tp"]}, {"cross_peer": 6})
    assert loop.run() == {"cross_peer": 1, "huge_tp": 1}
    cross = [i for i, k in loop.tries if k == "cross_peer"]
    assert cross == [1, 2, 3, 4, 5, 6]  # never twice at one request, fired at 6


def test_faults_flag_takes_all_none_or_named_kinds_and_names_an_unknown_one():
    from kvpush.apps.soak.common import FAULT_KINDS, chosen_faults

    assert chosen_faults("all") == FAULT_KINDS and chosen_faults("none") == ()
    assert chosen_faults("abort_mid_stream, kill_decode") == ("abort_mid_stream", "kill_decode")
    with pytest.raises(ValueError, match=r"unknown fault kind\(s\) \['sideways'\]"):
        chosen_faults("abort_mid_stream,sideways")
    with pytest.raises(ValueError, match=r"unknown fault kind\(s\) \[','\]"):
        chosen_faults(",")
