"""How the disconnect waves judge a wave (no engine): at rest within the bound passes; later passes only
when the prefill's lease explains it (the decode at rest at the bound, a push ended by lease, then rest);
never at rest, or a decode still holding at the bound, fails."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.platforms.vllm.tools.disconnect_stress import Wave, lease_bound, settled_in_bound

pytestmark = [pytest.mark.vllm]

REST = {"kv_usage": 0.0, "running": 0.0, "waiting": 0.0, "outstanding": 0}
HOLDING = {"kv_usage": 0.002, "running": 0.0, "waiting": 0.0, "outstanding": 1}


def _wave(settled_s: float | None, expiries: int = 0, at_bound: dict[str, Any] | None = None) -> Wave:
    return Wave(0, [0.1], settled_s=settled_s, lease_expiries=expiries, at_bound=at_bound or {})


def test_rest_within_the_bound_passes_whatever_the_lease_did():
    assert settled_in_bound(_wave(3.0), 20.0)
    assert settled_in_bound(_wave(20.0, expiries=0), 20.0)


def test_a_late_rest_passes_only_when_the_prefill_lease_explains_it():
    explained = _wave(31.0, expiries=1, at_bound={"prefill": HOLDING, "decode": REST})
    assert settled_in_bound(explained, 20.0)
    # no push ended by lease: something else held the prefill
    assert not settled_in_bound(_wave(31.0, expiries=0, at_bound={"prefill": HOLDING, "decode": REST}), 20.0)
    # the decode still held at the bound: the lease on the prefill cannot explain that
    assert not settled_in_bound(_wave(31.0, expiries=1, at_bound={"prefill": REST, "decode": HOLDING}), 20.0)


def test_never_at_rest_fails():
    assert not settled_in_bound(_wave(None, expiries=3, at_bound={"prefill": HOLDING, "decode": REST}), 20.0)


def test_the_lease_bound_is_the_documented_one_plus_reporting_slack():
    # lease_s + write_timeout_s + write_linger_s (docs/vllm.md) + 5 s for engine steps and stats files
    assert lease_bound(30.0) == 46.0
