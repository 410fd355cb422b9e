"""The anti-replay window (protocol/replay.py) against a plain model of the rule: a sequence number is
accepted once, and only while it is newer than the highest seen minus the window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.errors import WireError
from kvpush.protocol.handshake import Session
from kvpush.protocol.replay import REPLAY_WINDOW, ReplayWindow
from kvpush.protocol.wire import Codec, Ping


class Model:
    """The rule written the slow way: every number ever accepted, and the highest."""

    def __init__(self, size: int) -> None:
        self.size, self.highest, self.seen = size, 0, set[int]()

    def accept(self, seq: int) -> bool:
        if seq <= self.highest - self.size or seq in self.seen:
            return False
        self.seen.add(seq)
        self.highest = max(self.highest, seq)
        return True


@settings(max_examples=300, deadline=None)
@given(
    size=st.sampled_from([1, 2, 8, 64, REPLAY_WINDOW]),
    steps=st.lists(st.integers(-80, 80), min_size=1, max_size=300),
)
def test_the_window_accepts_exactly_what_the_rule_accepts(size: int, steps: list[int]) -> None:
    """Sequences that wander back and forth around the highest (steps relative to it), with jumps past
    the window and repeats; every answer equals the model's."""
    window, model = ReplayWindow(size), Model(size)
    for step in steps:
        seq = max(0, model.highest + step)
        assert window.accept(seq) == model.accept(seq), (size, seq, model.highest)
        assert window.highest == model.highest


def test_a_jump_far_ahead_forgets_the_old_window_without_building_a_huge_number() -> None:
    w = ReplayWindow()
    assert w.accept(5) and w.accept(2**62)
    assert not w.accept(5) and not w.accept(2**62)
    assert w.accept(2**62 - 1) and not w.accept(2**62 - REPLAY_WINDOW)
    assert w._bits.bit_length() <= REPLAY_WINDOW


def test_a_window_holds_at_least_one_number() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ReplayWindow(0)


def test_a_long_lived_session_refuses_replays_and_frames_older_than_its_window() -> None:
    """Many frames on one connection, opened newest first: a frame opened twice, or older than the window
    below the newest, is refused; one inside the window that never came is still accepted."""
    key = b"k" * 32
    codec = Codec()
    dec = Session(codec, key, b"n" * 16, b"m" * 16, "decode")
    pre = Session(codec, key, b"n" * 16, b"m" * 16, "prefill")
    frames = [dec.seal(Ping(clock=float(i))) for i in range(3 * REPLAY_WINDOW)]  # sequence i + 1
    for f in frames[: -REPLAY_WINDOW // 2 - 1 : -1]:  # the newest half-window, newest first
        pre.open(f)
    for f in (frames[-1], frames[-REPLAY_WINDOW // 2], frames[-REPLAY_WINDOW - 1], frames[0]):
        with pytest.raises(WireError, match="replayed"):
            pre.open(f)
    assert pre.open(frames[-REPLAY_WINDOW]) == Ping(clock=float(2 * REPLAY_WINDOW))  # the window's edge
