"""The ledger's counter names are one enum: every counter stats() reports is named by exactly one Count or
High member, so a misspelt counter is a type error rather than a runtime AttributeError."""

from __future__ import annotations

from dataclasses import fields

from kvpush.endpoint.stats import Count, Counters, High, Ledger


def test_every_counter_has_exactly_one_name():
    names = [c.value for c in Count] + [h.value for h in High]
    assert sorted(names) == sorted(f.name for f in fields(Counters))


def test_add_and_high_update_the_snapshot():
    ledger = Ledger("prefill", "test-stats", 0)
    ledger.add(Count.WRITES)
    ledger.add(Count.BYTES, 10)
    ledger.high(High.INFLIGHT_BYTES_MAX, 7)
    ledger.high(High.INFLIGHT_BYTES_MAX, 3)  # a high-water mark never goes down
    snap = ledger.snapshot()
    assert (snap["writes"], snap["bytes"], snap["inflight_bytes_max"]) == (1, 10, 7)
