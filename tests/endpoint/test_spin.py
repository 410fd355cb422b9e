"""pacing.spin_s: after activity an idle transfer thread keeps polling at busy_poll_s for spin_s, then
blocks on its doorbell (issue 20 item 4: a thread woken from a block starts its next request slow)."""

from __future__ import annotations

import os
import time

import pytest

from kvpush.config import KVPushConfig
from kvpush.endpoint.loop import TransferLoop, idle_wait_ms
from kvpush.errors import ConfigError


class Counting:
    """A role with nothing in flight that counts its loop's rounds."""

    name = "kvpush-counting"

    def __init__(self, config: KVPushConfig) -> None:
        self.config = config
        self.rounds = 0

    def setup(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def step(self, now: float) -> bool:
        self.rounds += 1
        return False

    def busy(self) -> bool:
        return False

    def in_flight(self) -> bool:
        return False

    def idle_wait_ms(self) -> int:
        return idle_wait_ms(self.config.pacing, 0)

    def wound_down(self) -> None:
        pass


def counting(config: KVPushConfig) -> TransferLoop[Counting]:
    return TransferLoop(config.pacing, lambda loop: Counting(config))


def rounds_after_a_command(spin_s: float) -> tuple[int, int]:
    """Rounds in the 0.15 s after one command, and in the 0.15 s after that (idle_poll_s 1 s: a thread
    that blocks makes at most one round per doorbell)."""
    t = counting(KVPushConfig(pacing={"idle_poll_s": 1.0, "busy_poll_s": 1e-4, "spin_s": spin_s}))
    t.start()
    try:
        t.call(lambda: None, timeout=5)
        start = t.role.rounds
        time.sleep(0.15)
        first = t.role.rounds - start
        time.sleep(0.15)
        return first, t.role.rounds - start - first
    finally:
        t.stop()


def test_spin_polls_after_activity_then_blocks():
    spun, after = rounds_after_a_command(0.05)
    assert spun >= 20  # polled at the busy cadence through the 50 ms window (>= 2.5 ms a round allowed)
    assert after <= 1  # then blocked on the doorbell: no round without a reason


def test_no_spin_blocks_at_once():
    first, after = rounds_after_a_command(0.0)
    assert first <= 2 and after <= 1


def test_spin_s_is_bounded():
    assert KVPushConfig.from_mapping({"spin_s": 2e-4}).pacing.spin_s == 2e-4
    for bad in (-1e-6, 0.5):
        with pytest.raises(ConfigError, match="spin_s must be within 0..0.1 s"):
            KVPushConfig.from_mapping({"spin_s": bad})


def test_doorbell_emptied_after_the_work_and_no_command_lost():
    """The doorbell is read after the work its ring announced, then the commands are looked at again: no
    command waits for a later ring (idle_poll_s 1 s: a lost ring would stall it for seconds), and an idle
    thread is left with an empty pipe (it blocks, it does not spin on a readable doorbell)."""
    t = counting(KVPushConfig(pacing={"idle_poll_s": 1.0, "busy_poll_s": 1e-4}))
    t.start()
    ran: list[int] = []
    try:
        for burst in range(60):
            for i in range(3):
                t.submit(lambda i=i: ran.append(i))
            time.sleep(0.0005 * (burst % 3))
        deadline = time.monotonic() + 0.5
        while len(ran) < 180 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(ran) == 180
        time.sleep(0.05)
        with pytest.raises(BlockingIOError):
            os.read(t.doorbell.read_fd, 1)
        rounds = t.role.rounds
        time.sleep(0.1)
        assert t.role.rounds - rounds <= 1
    finally:
        t.stop()
