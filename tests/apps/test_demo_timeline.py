"""The demo's per-WRITE timeline split by the event that came last (what scripts/write_cost.py reports)."""

from __future__ import annotations

from kvpush.apps.demo.timeline import timeline_us


def _marks(t0: float, registered: float, prefill_done: float, steps_us: list[float]) -> dict[str, float]:
    """A request's marks: registered and prefill_done at the given offsets (s), then picked, plan_built,
    sealed, queued, made, posted each `steps_us` after the previous one (the first after the trigger)."""
    marks = {"registered": t0 + registered, "prefill_done": t0 + prefill_done}
    at = max(marks.values())
    for name, step in zip(
        ("picked", "plan_built", "sealed", "queued", "made", "posted"), steps_us, strict=True
    ):
        at += step * 1e-6
        marks[name] = at
    marks["complete"] = at + 50e-6
    return marks


def test_stages_are_split_by_the_event_that_came_last() -> None:
    reqs = []
    for i in range(5):  # registration first, then prefill_done: a doorbell wake, nothing to plan
        reqs.append((_marks(10.0 * i, 0.0, 1.0, [20, 0, 0, 8, 4, 300]), 10.0 * i + 2.0))
    for i in range(5, 10):  # prefill_done first: the registration's read, machine and plan at the trigger
        reqs.append((_marks(10.0 * i, 1.0, 0.0, [70, 50, 7, 3, 20, 300]), 10.0 * i + 2.0))
    reqs.append((_marks(200.0, 1.0, 0.0, [1, 1, 1, 1, 1, 1]), 0.0))  # never ready: left out
    out = timeline_us(reqs)
    assert out["requests"] == 10
    assert out["per_write_by_order"] == {"prefill_done_last": 32.0, "registration_last": 150.0}
    by = out["stages_by_order"]
    assert by["registration_last"] == {"wake": 70.0, "plan": 50.0, "seal": 7.0, "queue": 3.0, "make": 20.0,
                                       "copy": 300.0}  # fmt: skip
    assert by["prefill_done_last"]["wake"] == 20.0 and by["prefill_done_last"]["plan"] == 0.0
    assert out["wake_by_order"] == {"prefill_done_last": 20.0, "registration_last": 70.0}
