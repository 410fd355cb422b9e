"""The anti-replay window of one authenticated channel, sans-IO.

A sealed frame carries a sequence number; a number seen before, or older than the window below the
highest seen, is a replay. The window is one integer used as a bit set (bit i: highest - i was seen), so
accepting a frame is a shift and an or whatever the window's size. (A set of the numbers inside the window,
pruned on every new highest, cost ~175 µs a frame once a connection had carried 4,096 of them.)
"""

from __future__ import annotations

REPLAY_WINDOW = 4096  # sequence numbers remembered below the highest seen, per channel


class ReplayWindow:
    """The sequence numbers seen on one channel: the highest, and which of the `size` below it came."""

    __slots__ = ("_bits", "_mask", "highest", "size")

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"a replay window holds at least one number, got {size}")
        self.size = size
        self.highest = 0
        self._bits = 0  # bit i set: highest - i was accepted
        self._mask = (1 << size) - 1

    def accept(self, seq: int) -> bool:
        """True, and seq is remembered, if it is new and inside the window; False for a replay."""
        ahead = seq - self.highest
        if ahead > 0:
            self._bits = 1 if ahead >= self.size else ((self._bits << ahead) | 1) & self._mask
            self.highest = seq
            return True
        back = -ahead
        if back >= self.size or (self._bits >> back) & 1:
            return False
        self._bits |= 1 << back
        return True
