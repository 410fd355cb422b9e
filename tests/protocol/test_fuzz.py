"""Fuzzing the wire boundary: whatever bytes arrive, decoding returns a message or raises WireError.

Bounded example counts keep this in CI's seconds; `kvpush fuzz --cases N` runs the same generators at
scale (kvpush/apps/fuzz.py).
"""

from __future__ import annotations

import contextlib
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.apps.fuzz import mutate, run_cases, seed_frames
from kvpush.errors import WireError
from kvpush.protocol.wire import MAX_DEPTH, Codec

enc = msgspec.msgpack.Encoder().encode

# the reproduction from issue 12: 1000 nested arrays inside an unknown field of a registration
DEEP = b"\x83" + enc("kind") + enc("reg") + enc("v") + enc(1) + enc("x") + b"\x91" * 1000 + b"\xc0"


def decode_or_wire_error(codec: Codec, data: bytes) -> None:
    with contextlib.suppress(WireError):
        codec.decode(data)


def test_the_issue_reproduction_is_a_wire_error():
    with pytest.raises(WireError):
        Codec().decode(DEEP)
    current = DEEP.replace(enc("v") + enc(1), enc("v") + enc(2))
    with pytest.raises(WireError, match="unknown field"):
        Codec().decode(current)


def test_nesting_before_the_header_is_refused_naming_the_depth():
    data = b"\x83" + enc("x") + b"\x91" * 1000 + b"\xc0" + enc("kind") + enc("reg") + enc("v") + enc(2)
    with pytest.raises(WireError, match="nested deeper than"):
        Codec().decode(data)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000, 200_000])
def test_deep_nesting_anywhere_is_refused(depth):
    for opener in (b"\x91", b"\x81\xa1k"):  # arrays, and maps whose value nests further
        data = b"\x82" + enc("kind") + enc("reg") + enc("v") + opener * depth + b"\xc0"
        with pytest.raises(WireError):
            Codec().decode(data)
        with pytest.raises(WireError):
            Codec().decode(opener * depth + b"\xc0")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_only_raise_wire_error(data):
    decode_or_wire_error(Codec(), data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 8))
def test_mutated_valid_frames_only_raise_wire_error(seed, rounds):
    rng = random.Random(seed)
    codec = Codec()
    for frame in seed_frames():
        decode_or_wire_error(codec, mutate(frame, rng, rounds))


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["hello", "reg", "done", "fail", "abort", "error", "ping", "pong", "zz"]), json_like)
def test_structured_garbage_under_a_real_kind_only_raises_wire_error(kind, extra):
    for body in ({"kind": kind, "v": 2, "x": extra}, {"kind": kind, "v": 2, "request_id": extra}):
        decode_or_wire_error(Codec(), enc(body))


def test_the_cli_runner_reports_zero_crashes():
    report = run_cases(3000, seed=7)
    assert report["cases"] == 3000
    assert report["crashes"] == 0, report
    assert sum(report["errors_by_kind"].values()) + report["decoded"] == 3000
