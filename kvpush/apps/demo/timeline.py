"""The push thread's per-WRITE timeline (kvpush.endpoint.prefill.TIMELINE) as p50 spans in microseconds:
what `kvpush demo` reports as its per-request fixed cost, stage by stage."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else 0.0


# The per-WRITE stages of the push thread's timeline (kvpush.endpoint.prefill.TIMELINE), in order; each
# span runs from the previous stage's mark ("trigger": the later of registration and prefill-done).
STAGES = (
    ("wake", "picked"),  # the thread hop (doorbell or side channel) and the sender machine
    ("plan", "plan_built"),
    ("seal", "sealed"),
    ("queue", "queued"),
    ("make", "made"),  # dispatch (budget, posting thread) and NIXL's make_prepped_xfer
    ("copy", "posted"),  # the post; on UCX loopback the copy runs inside it
)


def timeline_us(reqs: Iterable[tuple[Mapping[str, float] | None, float]]) -> dict[str, Any]:
    """Per-request fixed cost, p50 in microseconds, over (timeline, decode ready time) pairs of the
    requests that succeeded (a ready time of 0: skipped): the trigger is the later of registration and
    prefill-done (what lets the WRITE start); decode_ready is the decode endpoint's result time.
    `stages`: each span of STAGES; `kvpush_per_write`: trigger -> made (kvpush's own work, no copy)."""
    spans: dict[str, list[float]] = {
        "trigger_to_plan_built": [],
        "trigger_to_posted": [],
        "prefill_done_to_posted": [],
        "posted_to_complete": [],
        "complete_to_decode_ready": [],
        # NIXL only: `made` is after make_prepped_xfer, before the post; on UCX loopback the copy runs
        # inside the post, so trigger -> made is kvpush's per-request cost (plus NIXL's make) without it
        "trigger_to_made": [],
        "made_to_posted": [],
    }
    # each stage by which event came last: prefill_done (a command and a doorbell) or the registration
    # (a side-channel message, decoded and admitted before the machine sees it)
    orders = ("prefill_done_last", "registration_last")
    per_write: dict[str, list[float]] = {order: [] for order in orders}
    by_order: dict[str, dict[str, list[float]]] = {
        order: {name: [] for name, _ in STAGES} for order in orders
    }
    for timeline, ready_at in reqs:
        t = timeline or {}
        if not ready_at or not {"registered", "prefill_done", "plan_built", "posted", "complete"} <= set(t):
            continue
        trigger = max(t["registered"], t["prefill_done"])
        last = orders[0] if t["prefill_done"] >= t["registered"] else orders[1]
        spans["trigger_to_plan_built"].append(1e6 * (t["plan_built"] - trigger))
        spans["trigger_to_posted"].append(1e6 * (t["posted"] - trigger))
        if last == orders[0]:
            spans["prefill_done_to_posted"].append(1e6 * (t["posted"] - t["prefill_done"]))
        spans["posted_to_complete"].append(1e6 * (t["complete"] - t["posted"]))
        spans["complete_to_decode_ready"].append(1e6 * (ready_at - t["complete"]))
        if "made" in t:
            spans["trigger_to_made"].append(1e6 * (t["made"] - trigger))
            per_write[last].append(1e6 * (t["made"] - trigger))
            spans["made_to_posted"].append(1e6 * (t["posted"] - t["made"]))
        if all(mark in t for _, mark in STAGES):
            prev = trigger
            for name, mark in STAGES:
                by_order[last][name].append(1e6 * (t[mark] - prev))
                prev = t[mark]
    out: dict[str, Any] = {k: _p50(v) for k, v in spans.items()}
    out["kvpush_per_write"] = out["trigger_to_made"]
    out["stages"] = {name: _p50([v for o in orders for v in by_order[o][name]]) for name, _ in STAGES}
    out["wake_by_order"] = {o: _p50(by_order[o]["wake"]) for o in orders}
    out["per_write_by_order"] = {k: _p50(v) for k, v in per_write.items()}
    out["stages_by_order"] = {o: {k: _p50(v) for k, v in st.items()} for o, st in by_order.items()}
    out["requests"] = len(spans["trigger_to_posted"])
    return out
