"""The soak's figures: why a failed request failed (its kind, as the endpoints' results name it), the
report the run ends with, and the table `kvpush soak` prints. FAIL_ON lists the figures that must be zero."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Any, Protocol

from kvpush.apps.soak.common import FAULT_KINDS
from kvpush.protocol.reasons import Failure


class SoakRun(Protocol):
    """What the report reads of a finished run (the driver's Soak; a Protocol, so report.py does not
    import the driver that imports it)."""

    book: Any
    kids: Any
    args: argparse.Namespace
    faults: Counter[str]
    attacks: Counter[str]
    hello_answers: int
    check: str
    cross_peer_writes: int
    huge_tp_accepted: int
    long_prompts: list[str]
    stream_ranges: int
    mid_stream_aborted: int


FAIL_ON = (
    "leaked_blocks_prefill",
    "leaked_blocks_decode",
    "corrupt_bytes",
    "stale_writes",
    "unauthorized_accepted",
    "huge_tp_accepted",
    "cross_peer_accepted",  # the ownership rule (protocol/claims.py)
    "kept_state_at_end",  # per-request state a transfer thread kept at rest (endpoint/kept.py)
)
REPORTED: tuple[str, ...] = ()  # figures shown but not yet held to zero

# A failed request's kind in the report: its Failure's value (the endpoint's result says it, the decode's
# from the prefill's own over the wire), or one the soak knows of itself:
ATTACKER = "attacker"  # an honest request ended by the attacker's (or another key holder's) frames
PROCESS_KILLED = "process_killed"  # the engine holding it was killed (its memory went with it)
WRONG_BYTES = "wrong_bytes"  # declared ready, but its bytes failed the pattern
UNKNOWN = "unknown"  # settled failed with no result naming a kind


def kind_of(failure: Failure | None) -> str:
    """A result's failure kind as the report counts it."""
    return UNKNOWN if failure is None else failure.value


def build_report(
    soak: SoakRun,
    elapsed: float,
    p_reply: tuple[Any, ...],
    d_reply: tuple[Any, ...],
    kept: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """The run's figures; p_reply and d_reply are the engines' ("stats", counters, pending) answers,
    kept what each one's transfer thread still keeps per request at rest (non-zero maps only)."""
    book, kids, args = soak.book, soak.kids, soak.args
    p_leak, p_dup = book.leaked(book.p_alloc, book.p_geo.num_blocks)
    d_leak, d_dup = book.leaked(book.d_alloc, book.d_geo.num_blocks)
    reqs = list(book.reqs.values())
    failed = [r for r in reqs if r.outcome == "failed"]
    return {
        "command": "kvpush soak " + " ".join(args.argv),
        "seed": args.seed,
        "requests": len(reqs),
        "completed": sum(1 for r in reqs if r.outcome == "completed"),
        "failed_with_reason": {
            "count": len(failed),
            "by_kind": dict(sorted(book.reasons.items())),
            "examples": book.examples,
        },
        "unsettled": len(book.live()),
        "leaked_blocks_prefill": p_leak,
        "leaked_blocks_decode": d_leak,
        "double_returned_blocks": p_dup + d_dup + book.double_freed,
        "corrupt_bytes": book.corrupt,
        "stale_writes": book.stale,
        "unauthorized_accepted": book.unauthorized,
        "huge_tp_accepted": soak.huge_tp_accepted,
        # honest requests another bound identity aborted + its registrations that wrote the lent blocks
        "cross_peer_accepted": book.cross_peer + soak.cross_peer_writes,
        "kept_state_at_end": sum(n for maps in kept.values() for n in maps.values()),
        "kept_at_end": kept,
        "long_prompts": {
            "started": len(soak.long_prompts),
            "completed": sum(1 for rid in soak.long_prompts if book.reqs[rid].outcome == "completed"),
            "tokens": book.reqs[soak.long_prompts[0]].n if soak.long_prompts else 0,
        },
        "streamed": {
            "started": dict(Counter(r.shape for r in reqs if r.shape != "whole")),
            "completed": dict(
                Counter(r.shape for r in reqs if r.shape != "whole" and r.outcome == "completed")
            ),
            "ranges_reported": soak.stream_ranges,
            "aborted_mid_stream_by_prefill": soak.mid_stream_aborted,
            # failure kinds by shape, "whole" included: a streamed path that failed more than faults
            # explain would show here first
            "failed_by_shape": {
                shape: dict(Counter(r.kind for r in failed if r.shape == shape))
                for shape in sorted({r.shape for r in reqs})
            },
        },
        "faults_injected": {k: soak.faults.get(k, 0) for k in FAULT_KINDS},
        "attacker_frames_sent": dict(soak.attacks),
        "attacker_hello_answers": soak.hello_answers,
        "restarts": {"prefill": kids.gens["prefill"] - 1, "decode": kids.gens["decode"] - 1},
        "endpoint_pending_at_end": {"prefill": p_reply[2], "decode": d_reply[2]},
        "prefill_stats": p_reply[1],
        "decode_stats": d_reply[1],
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(len(reqs) / max(elapsed, 1e-9), 2),
        "load_average": list(os.getloadavg()),
        "self_check": soak.check or None,
        "notes": book.log[:50],
    }


def print_report(report: dict[str, Any], args: argparse.Namespace) -> int:
    """The summary table and the first notes; 1 if a figure that must be zero is not."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"kvpush soak: {report['requests']} requests, faults {args.faults}, seed {args.seed}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("requests", "completed", "unsettled", *FAIL_ON, "double_returned_blocks", *REPORTED):
        table.add_row(key, str(report[key]))
    longs = report["long_prompts"]
    table.add_row("long prompts completed / started", f"{longs['completed']} / {longs['started']}")
    streamed = report["streamed"]
    table.add_row(
        "streamed completed / started",
        f"{sum(streamed['completed'].values())} / {sum(streamed['started'].values())}",
    )
    table.add_row("streamed ranges reported", str(streamed["ranges_reported"]))
    table.add_row("failed", str(report["failed_with_reason"]["count"]))
    for kind, count in report["failed_with_reason"]["by_kind"].items():
        table.add_row(f"  failed: {kind}", str(count))
    for kind, count in report["faults_injected"].items():
        table.add_row(f"  fault: {kind}", str(count))
    table.add_row("elapsed s / requests per s", f"{report['elapsed_s']} / {report['requests_per_s']}")
    console.print(table)
    for line in report["notes"][:10]:
        console.print(f"[yellow]{line}")
    bad = [k for k in (*FAIL_ON, "double_returned_blocks", "unsettled") if report[k]]
    if bad:
        console.print(f"[red]soak failed: {', '.join(bad)} not zero")
        return 1
    return 0
