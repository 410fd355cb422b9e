"""`kvpush fuzz --cases N`: throw mutated and random frames at every decode path; count what happens.

Every path a peer's bytes reach (the body codec, a Hello frame with and without a key, an authenticated
session, with and without a key) must either return a message or raise WireError; past the codec, what an
endpoint then does with a decoded Hello (rebuild and check the peer's layout: layer ids, KV-cache groups,
windows, PP stage) or Registration (split `group_sizes`, check each group's table and its -1 holes) must
return or raise LayoutError. Anything else is a crash: in an endpoint it would reach the transfer thread.
Besides byte edits, a share of the cases edits wire v4's new fields inside an intact, canonical map, so
they get past the codec. The report gives cases, decoded messages, refusals grouped by kind, and crashes
(the run exits non-zero if there is any).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.table import Table

from ..errors import LayoutError, WireError
from ..protocol.groups import HOLE, check_group_tables
from ..protocol.handshake import (
    Session,
    check_peer_hello,
    hello_frame,
    layout_from_wire,
    make_hello,
    memory_of,
    open_hello,
    without_memory,
)
from ..protocol.layout import KVLayout, packed_planes
from ..protocol.tp import check_peer_tp, check_stage
from ..protocol.wire import (
    ENVELOPE_BYTES,
    KIND_CODES,
    MAGIC,
    SEALED,
    SEQ_BYTES,
    Abort,
    Codec,
    ErrorCode,
    ErrorReply,
    Hello,
    LayoutWire,
    Message,
    Ping,
    Pong,
    Posted,
    Registration,
    TransferDone,
    TransferFailed,
    envelope,
    hmac_tag,
)
from . import cliutil
from .cliutil import add_output_flags, emit_json, positive_int

_KEY = b"fuzzing-key-0123456789abcdef"
_NONCE_D, _NONCE_P = b"d" * 16, b"p" * 16


# wire v4's cache kinds: an FP8 MLA model of 8 layers in two KV-cache groups (full, window 8); the
# prefill seed is PP stage 1 of 2 (layers 4-7), TP rank 0 of 2; the decode holds every layer
def _kinds(num_layers: int, **kw: Any) -> KVLayout:
    return KVLayout(
        num_layers=num_layers, block_size=4, num_blocks=8, total_kv_heads=1, head_dim=8, dtype_size=1,
        kv_per_layer=1, **kw,
    )  # fmt: skip


_DECODE = packed_planes(_kinds(8, layer_group=(0, 1) * 4, group_window=(0, 8)), 4096)
_STAGE = packed_planes(
    _kinds(
        4,
        layer_ids=(4, 5, 6, 7),
        layer_group=(0, 1) * 2,
        group_window=(0, 8),
        tp_size=2,
        pp_rank=1,
        pp_size=2,
    ),
    4096,
)
_STAGE_PEER = packed_planes(_kinds(4, tp_size=2, tp_rank=1), 8192)


def grouped_messages() -> list[Message]:
    """Seeds with wire v4's fields set: a PP stage's Hello with groups and windows, and a Registration of
    two group tables (the window group's first blocks -1, outside the window)."""
    hello = make_hello("pre", "prefill", "agent-p", b"mp" * 40, "DRAM", _STAGE, nonce=_NONCE_P, clock=2.5)
    reg = Registration(
        request_id="req-g",
        attempt=1,
        decode_engine_id="dec",
        decode_rank=0,
        decode_tp=1,
        block_ids=[0, 1, 2, 3, 4, HOLE, HOLE, 5, 6, 7],
        num_tokens=19,
        expires_at=12.5,
        group_sizes=[5, 5],
    )
    return [hello, reg]


def seed_messages() -> list[Message]:
    layout = packed_planes(
        KVLayout(num_layers=2, block_size=4, num_blocks=8, total_kv_heads=2, head_dim=4, dtype_size=2), 4096
    )
    hello = make_hello("dec", "decode", "agent-d", b"md" * 40, "DRAM", layout, nonce=_NONCE_D, clock=1.5)
    return [
        *grouped_messages(),
        hello,
        Registration(
            request_id="req-1",
            attempt=3,
            decode_engine_id="dec",
            decode_rank=0,
            decode_tp=1,
            block_ids=[1, 2, 3],
            num_tokens=9,
            expires_at=12.5,
        ),
        TransferDone(request_id="req-1", attempt=3, prefill_rank=0, nbytes=4096),
        TransferFailed(request_id="req-1", attempt=3, prefill_rank=0, reason="lease", abandoned=True),
        Abort(request_id="req-1", attempt=3, decode_engine_id="dec", decode_rank=0, reason="client"),
        ErrorReply(reason="no", request_id="req-1", attempt=1, code=ErrorCode.HELLO_FIRST),
        Posted(request_id="req-1", attempt=3, prefill_rank=0),
        Ping(clock=3.0),
        Pong(clock=4.0),
        memory_of(hello),
        # a long prompt: wire v2 lost the header of any registration with ~4,090 block ids or more
        Registration(
            request_id="req-long",
            attempt=0,
            decode_engine_id="dec",
            decode_rank=0,
            decode_tp=1,
            block_ids=list(range(5000)),
            num_tokens=80_000,
            expires_at=12.5,
        ),
    ]


def seed_frames() -> list[bytes]:
    """Valid bodies and frames of every kind: what the mutator starts from."""
    codec = Codec()
    msgs = seed_messages()
    out = [codec.encode(m) for m in msgs]
    for hello in (m for m in msgs if isinstance(m, Hello)):
        out.append(hello_frame(codec, hello, None))
        out.append(hello_frame(codec, without_memory(hello), _KEY))  # a keyed Hello carries no memory
    for key in (None, _KEY):
        sess = Session(codec, key, _NONCE_D, _NONCE_P, "decode")
        out += [sess.seal(m) for m in msgs if not isinstance(m, Hello)]
    return out


def _edit_ints(values: list[Any], rng: random.Random, pick: list[int]) -> list[Any]:
    """One edit of an int list: an element replaced (from `pick`, or off by one), one dropped, one
    repeated, the list emptied, or made longer than any bound."""
    out = list(values)
    op = rng.randrange(5)
    if op == 0 and out:
        i = rng.randrange(len(out))
        out[i] = rng.choice([*pick, out[i] + 1, out[i] - 1])
    elif op == 1 and out:
        del out[rng.randrange(len(out))]
    elif op == 2 and out:
        out.insert(rng.randrange(len(out)), rng.choice(out))
    elif op == 3:
        out = []
    else:
        out = out + [rng.choice(pick)] * rng.choice([1, 16, 5000])
    return out


def mutate_fields(msg: Message, rng: random.Random) -> bytes:
    """`msg`'s body with one or two of wire v4's fields edited inside an intact, canonical map: a
    Registration's group_sizes and block ids (-1 holes anywhere), a Hello's layer_ids, layer_group,
    group_window, pp_rank, pp_size (and the TP they multiply with)."""
    body = msgspec.to_builtins(msg, builtin_types=(bytes,))
    if isinstance(msg, Registration):
        edits: dict[str, Callable[[Any], Any]] = {
            "group_sizes": lambda v: _edit_ints(v or [len(body["block_ids"])], rng, [0, 1, 5, 10, -1, 2**33]),
            "block_ids": lambda v: _edit_ints(v, rng, [HOLE, -2, 0, 7, 8, 2**40]),
            "num_tokens": lambda v: rng.choice([1, 3, 4, 5, 16, 17, 19, 20, 21, 40, 0]),
        }
        target = body
    else:
        layout = body["layout"]
        edits = {
            "layer_ids": lambda v: _edit_ints(v, rng, [0, 3, 4, 8, 2**20, -1]),
            "layer_group": lambda v: _edit_ints(v, rng, [0, 1, 2, 15, 16, -1]),
            "group_window": lambda v: _edit_ints(v, rng, [0, 4, 8, 9, 2**40, -1]),
            "pp_rank": lambda v: rng.choice([0, 1, 2, 4095, -1]),
            "pp_size": lambda v: rng.choice([1, 2, 3, 4096, 4097, 0]),
            "tp_size": lambda v: rng.choice([1, 2, 4, 2**16]),
            "num_layers": lambda v: rng.choice([1, 3, 4, 5, 8]),
        }
        target = layout
    for name in rng.sample(sorted(edits), rng.choice([1, 1, 2])):
        target[name] = edits[name](target[name])
    if isinstance(msg, Hello):
        # a peer that means harm sends the hash of the layout it describes: recompute it, so the edit
        # reaches the layout checks instead of stopping at the hash
        with contextlib.suppress(msgspec.ValidationError, LayoutError, TypeError, ValueError):
            body["compat"] = layout_from_wire(msgspec.convert(target, LayoutWire)).compat_hash()
    return envelope(msg) + msgspec.msgpack.encode(body)


def envelope_at(data: bytes) -> int:
    """Where a body's envelope starts: 0 in a bare body, 1 behind a frame's flag byte; -1 if none."""
    for off in (0, 1):
        if data[off : off + len(MAGIC)] == MAGIC:
            return off
    return -1


def _mutate_envelope(buf: bytearray, off: int, rng: random.Random) -> None:
    """One envelope byte changed: the magic, the version (off by one, or any), or the kind (another
    kind's code, so a body is read as the wrong message, or an unknown one)."""
    i = off + rng.randrange(ENVELOPE_BYTES)
    if i - off == 3 and rng.random() < 0.7:
        buf[i] = rng.choice([*KIND_CODES.values(), 0, 255])
    elif i - off == 2 and rng.random() < 0.7:
        buf[i] = (buf[i] + rng.choice([-1, 1])) & 0xFF
    else:
        buf[i] = rng.randrange(256)


def mutate(data: bytes, rng: random.Random, rounds: int = 1) -> bytes:
    """A few random edits: flips, inserts, deletes, truncation, duplication, nesting bombs, big ints,
    and edits of the wire v4 envelope (magic, version, kind) in front of an intact map."""
    buf = bytearray(data)
    for _ in range(rounds):
        op = rng.randrange(10)
        at = rng.randrange(len(buf) + 1)
        off = envelope_at(bytes(buf[:8]))
        if op == 9 and off >= 0 and len(buf) >= off + ENVELOPE_BYTES:
            _mutate_envelope(buf, off, rng)
        elif op == 0 and buf:
            buf[min(at, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[at:at] = rng.randbytes(rng.randrange(1, 16))
        elif op == 2 and buf:
            del buf[at : at + rng.randrange(1, 16)]
        elif op == 3:
            del buf[at:]
        elif op == 4 and buf:
            n = rng.randrange(1, 32)
            buf[at:at] = buf[at : at + n]
        elif op == 5:
            opener = rng.choice([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xdf\x00\x00\x00\x01\xc0"])
            buf[at:at] = opener * rng.choice([20, 200, 3000])
        elif op == 6:
            buf[at:at] = rng.choice([b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80" + b"\0" * 7])
        elif op == 7 and buf:
            buf[min(at, len(buf) - 1)] = rng.choice([0xC1, 0xDD, 0xDF, 0xC6, 0xDB, 0xC9, 0xD8])
        else:
            buf = bytearray(rng.randbytes(rng.randrange(0, 256)))
    return bytes(buf)


_CHECKED = object()


def endpoint_checks(msg: Message) -> object:
    """What an endpoint does with a decoded message past the codec: a Hello's layout rebuilt and checked
    against this side's (hash, compatibility, TP bound, PP stage), a Registration's group tables split and
    checked. LayoutError (or WireError) is a refusal; it returns _CHECKED when every check passed."""
    if isinstance(msg, Hello):
        prefill_side = msg.role != "prefill"
        peer = check_peer_hello(_STAGE_PEER if prefill_side else _DECODE, msg, prefill_side)
        check_peer_tp(peer, 64)
        if not prefill_side:
            check_stage(peer, 2, 2, 2)
        return _CHECKED
    if isinstance(msg, Registration):
        check_group_tables(_DECODE, msg.tables(), msg.num_tokens, "table")
        return _CHECKED
    return msg


def _kind_of(exc: WireError | LayoutError) -> str:
    """A refusal's kind: its message without the specifics (numbers, quoted values, details)."""
    # a layout refusal names its subject before a colon ("registration: KV-cache group 1: ..."): keep it all
    text = str(exc).replace(":", " ") if isinstance(exc, LayoutError) else str(exc).split(":")[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"|0x[0-9a-f]+|\d+", "#", text)
    return " ".join(text.split()[:8])


def run_cases(cases: int, seed: int = 0, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    codec = Codec()
    frames = seed_frames()
    sessions = [
        Session(codec, None, _NONCE_D, _NONCE_P, "prefill"),
        Session(codec, _KEY, _NONCE_D, _NONCE_P, "prefill"),
    ]
    peer_key = Session(codec, _KEY, _NONCE_D, _NONCE_P, "decode")

    def resealed(data: bytes) -> Message:
        """A mutated body behind a valid MAC and sequence number: what a key holder could send."""
        seq = peer_key._next.get(b"side", 1)
        peer_key._next[b"side"] = seq + 1
        raw = seq.to_bytes(SEQ_BYTES, "big")
        frame = bytes([SEALED]) + data + raw + hmac_tag(peer_key.key or b"", b"d2p", b"side", raw, data)
        return sessions[1].open(frame)

    paths: tuple[Callable[[bytes], object], ...] = (
        resealed,
        lambda d: codec.decode(d),
        lambda d: open_hello(codec, d, None),
        lambda d: open_hello(codec, d, _KEY),
        lambda d: sessions[0].open(d),
        lambda d: sessions[1].open(d),
        lambda d: endpoint_checks(codec.decode(d)),
        lambda d: endpoint_checks(open_hello(codec, d, None)),
    )
    grouped = grouped_messages()
    errors: Counter[str] = Counter()
    crashes: Counter[str] = Counter()
    examples: dict[str, str] = {}
    decoded = envelope_changed = fields_edited = deep = 0
    for case in range(cases):
        if progress is not None and case % 1024 == 0:
            progress(case)
        if rng.random() < 0.3:  # wire v4's fields edited in a canonical map: past the codec, to the checks
            data = mutate_fields(rng.choice(grouped), rng)
            fields_edited += 1
            path = paths[-2]
        else:
            start = rng.choice(frames)
            data = mutate(start, rng, rng.randrange(1, 5))
            off = envelope_at(start)
            envelope_changed += data[off : off + ENVELOPE_BYTES] != start[off : off + ENVELOPE_BYTES]
            path = rng.choice(paths)
        try:
            deep += path(data) is _CHECKED
            decoded += 1
        except (WireError, LayoutError) as exc:
            errors[_kind_of(exc)] += 1
        except Exception as exc:  # noqa: BLE001 - a crash is what we are counting
            key = type(exc).__name__
            crashes[key] += 1
            examples.setdefault(key, data[:200].hex())
    return {
        "cases": cases,
        "decoded": decoded,
        "envelope_changed": envelope_changed,  # cases whose wire v4 envelope differs from the seed's
        "fields_edited": fields_edited,  # cases with wire v4 fields edited in a canonical map
        "checked": deep,  # decoded and passed the endpoint's layout / block-table checks
        "errors_by_kind": dict(errors.most_common()),
        "crashes": sum(crashes.values()),
        "crashes_by_type": dict(crashes),
        "crash_examples_hex": examples,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=positive_int, default=100_000, help="inputs to try")
    parser.add_argument("--seed", type=int, default=0)
    add_output_flags(parser, "the report", "--output-json")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    with cliutil.progress(args.cases, "fuzz cases") as update:
        report = run_cases(args.cases, args.seed, update)
    report["seconds"] = round(time.monotonic() - t0, 1)
    if not emit_json(args, report):
        _print_text(report)
    return 1 if report["crashes"] else 0


def _print_text(report: dict[str, Any]) -> None:
    table = Table(title="kvpush fuzz", show_header=False, box=box.SIMPLE)
    table.add_column("what", style="bold")
    table.add_column("count", overflow="fold")
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
        table.add_row(key, str(value))
    Console(highlight=False).print(table)
