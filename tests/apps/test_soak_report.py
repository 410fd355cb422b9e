"""The soak sorts failed requests by the kind the endpoints' results name (the decode's, which since the
kind travels on the wire is the prefill's own when the prefill failed it), not by words in the reason:
reasons whose words suggest another kind must not move a request there."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from kvpush.apps.soak.book import Book
from kvpush.apps.soak.common import MARK, soak_geometry
from kvpush.apps.soak.report import build_report
from kvpush.protocol.reasons import Failure


def book() -> Book:
    return Book(soak_geometry(16, 64), soak_geometry(16, 64), seed=1)


def fail(b: Book, rid: str, reason: str, failure: Failure | None, p_failure: Failure | None = None) -> None:
    """One request through both engines: the prefill releases its source, the decode reports the attempt."""
    p_blocks = b.open(rid, 16, 7, p_gen=1)
    assert p_blocks is not None
    d_blocks = b.lend_decode(b.reqs[rid], d_gen=1)
    assert d_blocks is not None
    b.on_released(1, rid, "prefill: " + reason, p_failure or failure, p_blocks)
    b.on_result(1, rid, False, reason, failure, d_blocks, 0, True)


# each reason holds the words the substring classifier sorted it by, and the kind is another
MISLEADING = [
    ("lease expired while the WRITE timed out", Failure.WRITE_FAILED, "write_failed"),
    ("aborted by the decode: refused, superseded", Failure.PEER_SILENT, "peer_silent"),
    ("source already released", Failure.EXPIRED, "expired"),
    ("the endpoint closed", Failure.REFUSED, "refused"),
]


@pytest.mark.parametrize("reason, failure, kind", MISLEADING)
def test_a_failed_request_is_counted_under_its_kind_whatever_its_reason_says(reason, failure, kind):
    b = book()
    fail(b, "r", reason, failure)
    assert b.reasons == Counter({kind: 1}) and b.examples == {kind: reason}


def test_the_decodes_kind_comes_first_then_the_prefills_then_what_the_soak_knows():
    b = book()
    fail(b, "a", "x", Failure.ABORTED, Failure.EXPIRED)  # the decode's kind
    fail(b, "m", MARK, Failure.ABORTED)  # the attacker's frames ended it: counted as theirs
    assert b.open("k", 16, 8, p_gen=1) is not None  # a request whose prefill engine is killed
    b.reclaim("prefill", 1)
    assert b.reasons == Counter({"aborted": 1, "attacker": 1, "process_killed": 1})


def test_wrong_bytes_are_their_own_kind():
    b = book()
    p_blocks = b.open("w", 16, 7, p_gen=1)
    d_blocks = b.lend_decode(b.reqs["w"], d_gen=1)
    assert p_blocks is not None and d_blocks is not None
    b.on_released(1, "w", "", None, p_blocks)
    b.on_result(1, "w", True, "", None, d_blocks, 12, True)
    assert b.reasons == Counter({"wrong_bytes": 1}) and b.corrupt == 12


def test_the_report_counts_failures_by_kind_and_by_shape():
    b = book()
    for i, (reason, failure, _kind) in enumerate(MISLEADING):
        fail(b, f"r{i}", reason, failure)
    b.reqs["r0"].shape = "layers"

    run = argparse.Namespace(
        book=b,
        kids=argparse.Namespace(gens={"prefill": 1, "decode": 1}),
        args=argparse.Namespace(argv=[], seed=1),
        faults=Counter(),
        attacks=Counter(),
        hello_answers=0,
        check="",
        cross_peer_writes=0,
        huge_tp_accepted=0,
        long_prompts=[],
        stream_ranges=0,
        mid_stream_aborted=0,
    )
    report = build_report(run, 1.0, ("stats", {}, 0), ("stats", {}, 0), {})
    assert report["failed_with_reason"]["by_kind"] == {k: 1 for _r, _f, k in MISLEADING}
    assert report["streamed"]["failed_by_shape"] == {
        "layers": {"write_failed": 1},
        "whole": {"peer_silent": 1, "expired": 1, "refused": 1},
    }
