"""The soak's attacker: a local process without the key that sends forged frames, replays of captured
ones, and Hellos reusing the victim decode's engine id, each on a fresh DEALER connection to the
prefill's side channel, and reports whether any got a Hello back (a handshake the prefill accepted)."""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any

import msgspec
import zmq

from kvpush.apps.soak.common import CROSS_MARK, DECODE_ID, HOLDER_ID, MARK
from kvpush.protocol.handshake import Session, hello_frame
from kvpush.protocol.wire import HELLO_MAC, PLAIN, Abort, Codec, Hello, Registration, split_frame


class Attacker:
    """Builds each attack's frames and plays them against the prefill at 127.0.0.1:`port`.

    `self_check_key` is set only by `--self-check unauthorized`: then the "attacker" holds the key, as
    a compromised key holder would, and its Hello is accepted (SECURITY.md says it is)."""

    def __init__(
        self, ctx: zmq.Context[Any], port: int, self_check_key: bytes | None, holder_key: bytes
    ) -> None:
        self.ctx, self.port, self.self_check_key = ctx, port, self_check_key
        self.holder_key = holder_key  # for the key holder's attacks (cross_peer, huge_tp)
        self.codec = Codec()
        self.wrong_key = os.urandom(32)
        self.rng = random.Random(port)
        self.nonce = b""  # the self-check Hello's nonce, for its session

    def hello_of(self, frames: list[bytes]) -> Hello | None:
        """The first Hello among `frames` (a captured Hello, or the prefill's answer)."""
        for f in frames:
            with contextlib.suppress(Exception):
                _flag, body, _s, _t = split_frame(f, self.codec.max_bytes)
                msg = self.codec.decode(body)
                if isinstance(msg, Hello):
                    return msg
        return None

    def build(self, kind: str, rid: str, blocks: list[int], captured: list[bytes]) -> list[bytes]:
        """The frames of one attack of `kind` on request `rid` (empty: nothing captured to use yet)."""
        if kind == "forged":
            return self._forged(rid, blocks)
        if kind == "replayed":
            return list(captured)
        victim = self.hello_of(captured)
        if victim is None:
            return []
        if kind == "self_check":  # a key holder's own Hello: accepted, as SECURITY.md says it is
            if self.self_check_key is None:
                return []
            mine = msgspec.structs.replace(victim, engine_id="soak-key-holder", nonce=os.urandom(16))
            self.nonce = mine.nonce
            return [hello_frame(self.codec, mine, self.self_check_key)]
        # hijack: a Hello naming the victim decode's engine id, and the victim's own Hello
        forged = msgspec.structs.replace(victim, nonce=os.urandom(16), agent_name="soak-evil-agent")
        out = [hello_frame(self.codec, forged, self.wrong_key), hello_frame(self.codec, forged, None)]
        return out + [f for f in captured if f[:1] == bytes([HELLO_MAC])][-1:]

    def _forged(self, rid: str, blocks: list[int]) -> list[bytes]:
        """A registration and an abort, each in plain and sealed with a session of the wrong key."""
        reg = Registration(
            request_id=rid,
            attempt=1_000_000 + self.rng.randrange(1000),
            decode_engine_id=DECODE_ID,
            decode_rank=0,
            decode_tp=1,
            block_ids=blocks or [0],
            num_tokens=1,
            expires_at=1e12,
        )
        abort = Abort(request_id=rid, attempt=0, decode_engine_id=DECODE_ID, decode_rank=0, reason=MARK)
        s = Session(self.codec, self.wrong_key, os.urandom(16), os.urandom(16), "decode")
        plain = bytes([PLAIN])
        return [plain + self.codec.encode(reg), s.seal(reg), plain + self.codec.encode(abort), s.seal(abort)]

    def play(self, kind: str, rid: str, blocks: list[int], captured: list[bytes]) -> tuple[int, int]:
        """Send one attack on a fresh connection; (frames sent, Hello answers got)."""
        frames = self.build(kind, rid, blocks, captured)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        accepted = 0
        for f in frames:
            sock.send(f)
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            if not sock.poll(50):
                continue
            answer = self.hello_of([sock.recv()])
            if answer is None:
                continue
            accepted += 1  # answered; without the key the session is useless, and binds nothing
            for f in captured:  # try the victim's captured sealed frames on it anyway
                sock.send(f)
            if kind == "self_check" and self.self_check_key is not None:
                sock.send(self._key_holder_abort(rid, answer))
        sock.close()
        return len(frames), accepted

    def play_holder(
        self, kind: str, targets: list[tuple[str, int]], blocks: list[int], captured: list[bytes]
    ) -> tuple[int, int]:
        """A key holder's attack on a fresh connection: (frames sent, Hellos accepted that must not be).

        huge_tp: a Hello declaring decode TP 65,536 (2 KV heads); the prefill must refuse it by name.
        cross_peer: bound as HOLDER_ID, it registers lent `blocks` for the first target's request (with
        a huge attempt, to supersede the owner's) and aborts the second's; only the ownership rule of
        issue 16 finding 2 stops them (until then the soak reports their effects in cross_peer_accepted).
        """
        victim = self.hello_of(captured)
        if victim is None:
            return 0, 0
        mine = msgspec.structs.replace(
            victim, engine_id=HOLDER_ID, nonce=os.urandom(16), instance=os.urandom(16)
        )
        if kind == "huge_tp":
            wide = msgspec.structs.replace(victim.layout, tp_size=65536)  # the compat hash ignores TP
            mine = msgspec.structs.replace(mine, engine_id="soak-huge-tp", layout=wide)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        sock.send(hello_frame(self.codec, mine, self.holder_key))
        sent, answer = 1, None
        if sock.poll(1000):
            answer = self.hello_of([sock.recv()])
        if kind == "cross_peer" and answer is not None and targets:
            s = Session(self.codec, self.holder_key, mine.nonce, answer.nonce, "decode")
            rid, n = targets[0]
            reg = Registration(
                request_id=rid,
                attempt=1 << 30,
                decode_engine_id=HOLDER_ID,
                decode_rank=0,
                decode_tp=1,
                block_ids=blocks or [0],
                num_tokens=n,
                expires_at=answer.clock + 3.0,
            )
            frames = [s.seal(reg)]
            for victim_rid, _n in targets[1:]:
                for attempt in range(3):
                    frames.append(
                        s.seal(
                            Abort(
                                request_id=victim_rid,
                                attempt=attempt,
                                decode_engine_id=HOLDER_ID,
                                decode_rank=0,
                                reason=CROSS_MARK,
                            )
                        )
                    )
            for f in frames:
                sock.send(f)
            sent += len(frames)
            time.sleep(0.3)
        sock.close()
        return sent, int(kind == "huge_tp" and answer is not None)

    def _key_holder_abort(self, rid: str, answer: Hello) -> bytes:
        """A key holder with an identity of its own aborts another decode's request."""
        assert self.self_check_key is not None
        s = Session(self.codec, self.self_check_key, self.nonce, answer.nonce, "decode")
        evil = Abort(
            request_id=rid, attempt=0, decode_engine_id="soak-key-holder", decode_rank=0, reason=MARK
        )
        return s.seal(evil)
