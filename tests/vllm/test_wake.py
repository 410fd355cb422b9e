"""IdleWaiter / IdleWaker: an idle engine sleeps, a finished transfer wakes it at once."""

from __future__ import annotations

import threading
import time

from kvpush.platforms.vllm.wake import IdleWaiter, IdleWaker


def test_wait_times_out_without_a_wake_up() -> None:
    waiter = IdleWaiter()
    try:
        t0 = time.monotonic()
        assert waiter.wait(0.05) is False
        assert time.monotonic() - t0 >= 0.04
    finally:
        waiter.close()


def test_a_wake_from_another_thread_cuts_the_sleep_short() -> None:
    waiter = IdleWaiter()
    waker = IdleWaker(waiter.path)
    woke_at: list[float] = []

    def transfer_thread() -> None:
        time.sleep(0.05)
        woke_at.append(time.monotonic())
        waker.wake()
        time.sleep(0.05)
        waker.close()  # the socket belongs to this thread

    th = threading.Thread(target=transfer_thread)
    try:
        t0 = time.monotonic()
        th.start()
        assert waiter.wait(5.0) is True
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0  # far below the 5 s limit: woken, not timed out
        assert woke_at and time.monotonic() >= woke_at[0]
    finally:
        th.join()
        waiter.close()


def test_a_wake_that_came_while_busy_returns_at_once_and_is_consumed() -> None:
    waiter = IdleWaiter()
    waker = IdleWaker(waiter.path)
    try:
        for _ in range(10):  # more than the send queue holds: extra wake-ups are dropped, never block
            waker.wake()
        time.sleep(0.05)
        t0 = time.monotonic()
        assert waiter.wait(5.0) is True
        assert time.monotonic() - t0 < 1.0
        assert waiter.wait(0.02) is False  # all pending wake-ups were drained by the first wait
    finally:
        waker.close()
        waiter.close()


def test_sockets_of_dead_engines_are_removed_and_live_ones_kept(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from kvpush.platforms.vllm.wake import remove_stale_sockets

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    (tmp_path / f"kvpush-wake-{dead_pid}-abc").write_text("")
    (tmp_path / f"kvpush-wake-{os.getpid()}-def").write_text("")
    (tmp_path / "kvpush-wake-notapid-x").write_text("")
    (tmp_path / "unrelated").write_text("")
    assert remove_stale_sockets(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"kvpush-wake-{os.getpid()}-def", "kvpush-wake-notapid-x", "unrelated"]
    )
