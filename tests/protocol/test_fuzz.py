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
from kvpush.protocol.wire import KIND_CODES, MAGIC, WIRE_VERSION, Codec, Registration

enc = msgspec.msgpack.Encoder().encode
REG_ENVELOPE = MAGIC + bytes((WIRE_VERSION, KIND_CODES[Registration]))

# the reproduction from issue 12: 1000 nested arrays inside an unknown field of a registration
DEEP = REG_ENVELOPE + b"\x81" + enc("x") + b"\x91" * 1000 + b"\xc0"


def decode_or_wire_error(codec: Codec, data: bytes) -> None:
    with contextlib.suppress(WireError):
        codec.decode(data)


def test_the_issue_reproduction_is_a_wire_error_naming_the_unknown_field():
    with pytest.raises(WireError, match="unknown field"):
        Codec().decode(DEEP)


def test_nesting_before_the_known_fields_is_refused():
    data = REG_ENVELOPE + b"\x82" + enc("x") + b"\x91" * 1000 + b"\xc0" + enc("attempt") + enc(2)
    with pytest.raises(WireError, match="unknown field"):
        Codec().decode(data)


@pytest.mark.parametrize("depth", [17, 5000, 200_000])
def test_deep_nesting_anywhere_is_refused(depth):
    for opener in (b"\x91", b"\x81\xa1k"):  # arrays, and maps whose value nests further
        for field in ("block_ids", "request_id", "x"):
            data = REG_ENVELOPE + b"\x81" + enc(field) + opener * depth + b"\xc0"
            with pytest.raises(WireError):
                Codec(max_bytes=1 << 22).decode(data)
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
    # the wire v4 envelope is fuzzed too, and its refusals are reported by kind
    assert report["envelope_changed"] >= 300, report["envelope_changed"]
    kinds = " ".join(report["errors_by_kind"])
    assert "unsupported wire version" in kinds and "unknown message kind" in kinds, kinds
    # wire v4's fields (group_sizes, -1 holes, layer ids, groups, windows, PP stage) get past the codec
    # into the layout and block-table checks, which refuse by name; some edits pass every check
    assert report["fields_edited"] >= 600 and report["checked"] >= 30, report
    for kind in (
        "layer_ids names",  # a Hello's layer_ids of another length than its layers
        "layout mismatch layer",  # a layer in another KV-cache group than the decode's
        "runs PP",  # a stage the address does not name
        "block # of the",  # a -1 hole where the window needs tokens
        "invalid Registration",  # group_sizes that do not add up, or out of range
    ):
        assert kind in kinds, (kind, kinds)
