"""`kvpush fuzz --cases N`: throw mutated and random frames at every decode path; count what happens.

Every path a peer's bytes reach (the body codec, a Hello frame with and without a key, an authenticated
session, with and without a key) must either return a message or raise WireError. Anything else is a
crash: in an endpoint it would reach the transfer thread. The report gives cases, decoded messages,
refusals grouped by kind, and crashes (the run exits non-zero if there is any).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import Counter
from typing import Any

from ..errors import WireError
from ..protocol.handshake import Session, hello_frame, make_hello, memory_of, open_hello, without_memory
from ..protocol.layout import KVLayout, packed_planes
from ..protocol.wire import (
    ENVELOPE_BYTES,
    KIND_CODES,
    MAGIC,
    SEALED,
    SEQ_BYTES,
    Abort,
    Codec,
    ErrorReply,
    Hello,
    Message,
    Ping,
    Pong,
    Posted,
    Registration,
    TransferDone,
    TransferFailed,
    hmac_tag,
)
from .cliutil import alias, positive_int

_KEY = b"fuzzing-key-0123456789abcdef"
_NONCE_D, _NONCE_P = b"d" * 16, b"p" * 16


def seed_messages() -> list[Message]:
    layout = packed_planes(
        KVLayout(num_layers=2, block_size=4, num_blocks=8, total_kv_heads=2, head_dim=4, dtype_size=2), 4096
    )
    hello = make_hello("dec", "decode", "agent-d", b"md" * 40, "DRAM", layout, nonce=_NONCE_D, clock=1.5)
    return [
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
        ErrorReply(reason="no", request_id="req-1", attempt=1, code="hello_first"),
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
    hello = msgs[0]
    assert isinstance(hello, Hello)
    out.append(hello_frame(codec, hello, None))
    out.append(hello_frame(codec, without_memory(hello), _KEY))  # a keyed Hello carries no memory
    for key in (None, _KEY):
        sess = Session(codec, key, _NONCE_D, _NONCE_P, "decode")
        out += [sess.seal(m) for m in msgs[1:]]
    return out


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
    and edits of the wire v3 envelope (magic, version, kind) in front of an intact map."""
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


def _kind_of(exc: WireError) -> str:
    """A refusal's kind: its message without the specifics (numbers, quoted values, details)."""
    text = str(exc).split(":")[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"|0x[0-9a-f]+|\d+", "#", text)
    return " ".join(text.split()[:8])


def run_cases(cases: int, seed: int = 0) -> dict[str, Any]:
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

    paths = (
        resealed,
        lambda d: codec.decode(d),
        lambda d: open_hello(codec, d, None),
        lambda d: open_hello(codec, d, _KEY),
        lambda d: sessions[0].open(d),
        lambda d: sessions[1].open(d),
    )
    errors: Counter[str] = Counter()
    crashes: Counter[str] = Counter()
    examples: dict[str, str] = {}
    decoded = envelope_changed = 0
    for _ in range(cases):
        start = rng.choice(frames)
        data = mutate(start, rng, rng.randrange(1, 5))
        off = envelope_at(start)
        envelope_changed += data[off : off + ENVELOPE_BYTES] != start[off : off + ENVELOPE_BYTES]
        try:
            rng.choice(paths)(data)
            decoded += 1
        except WireError as exc:
            errors[_kind_of(exc)] += 1
        except Exception as exc:  # noqa: BLE001 - a crash is what we are counting
            key = type(exc).__name__
            crashes[key] += 1
            examples.setdefault(key, data[:200].hex())
    return {
        "cases": cases,
        "decoded": decoded,
        "envelope_changed": envelope_changed,  # cases whose wire v3 envelope differs from the seed's
        "errors_by_kind": dict(errors.most_common()),
        "crashes": sum(crashes.values()),
        "crashes_by_type": dict(crashes),
        "crash_examples_hex": examples,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=positive_int, default=100_000, help="inputs to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", dest="json", metavar="PATH", help="also write the report as JSON")
    alias(parser, "--json", "json", metavar="PATH")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    report = run_cases(args.cases, args.seed)
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    return 1 if report["crashes"] else 0
