"""The soak's driver: starts requests, injects the driver-level faults at seeded random points, and
drains the run until every block is back.

The driver owns every block pool and hands block tables to the engines (`Book`); the child processes and
their messages are `Children`'s; the figures are `report`'s."""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from typing import Any

from kvpush.apps.ports import free_port_range
from kvpush.apps.soak.book import Book, Req
from kvpush.apps.soak.children import Children, Proc
from kvpush.apps.soak.common import (
    DRIVER_FAULTS,
    TRANSPORT_RATES,
    chosen_faults,
    soak_config,
    soak_geometry,
)
from kvpush.apps.soak.relay import Relay
from kvpush.apps.soak.report import build_report
from kvpush.apps.soak.stream import STREAMED

CROSS_AUDIT_S = 8.0  # past the attack registration's expiry and WRITE bound: audit the lent blocks


class Soak:
    """The parent: owns the pools, starts requests, injects the driver-level faults, collects results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.check: str = args.self_check
        self.kinds = chosen_faults(args.faults)
        rates = {k: rate for k, rate in TRANSPORT_RATES.items() if k in self.kinds}
        p_tp, d_tp = args.tp
        self.book = Book(
            soak_geometry(16, args.prefill_blocks, p_tp),
            soak_geometry(32, args.decode_blocks, d_tp),
            args.seed,
        )
        self.kids = Children(
            self.book.p_geo,
            self.book.d_geo,
            free_port_range(p_tp),
            rates,
            args.seed,
            self.check,
            on_message=self._on_message,
            on_tick=self._on_tick,
        )
        # the decode dials the prefill through a relay that the reset_side_channel fault resets
        self.relay = Relay(self.kids.port, ranks=p_tp, listen_port=free_port_range(p_tp) if p_tp > 1 else 0)
        self.kids.dial_port = self.relay.port
        self.heal_at = 0.0
        self.lent: list[tuple[float, list[int]]] = []  # (audit at, decode blocks lent to a cross_peer attack)
        self.cross_peer_writes = 0  # cross_peer registrations whose WRITE landed in the lent blocks
        self.huge_tp_accepted = 0
        self.long_prompts: list[str] = []
        self.faults: Counter[str] = Counter()
        self.attacks: Counter[str] = Counter()  # attacker frames sent, by attack kind
        self.captured: list[bytes] = []
        self.captures = 0
        self.hello_answers = 0  # Hellos the prefill answered to the attacker (they bind nothing)
        self.pending_attacks: list[tuple[float, str]] = []  # (when, kind)
        # streamed requests: their own generator, so the fault schedule of a seed does not move
        self.stream_rng = random.Random(args.seed + 7)
        self.mid_stream_owed = 0  # abort_mid_stream faults waiting for the next streamed request
        self.stream_ranges = 0  # kv_ready calls the prefill made, over all its incarnations
        self.mid_stream_aborted = 0  # streamed requests the prefill aborted itself after some ranges

    # -- messages ----------------------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        self.kids.pump(timeout)

    def _on_tick(self) -> None:
        now = time.monotonic()
        if self.heal_at and now >= self.heal_at:
            self.heal_at = 0.0
            self.relay.heal()
        for at, blocks in list(self.lent):
            if now >= at and self.kids.decode is not None and not self.kids.decode.stopped_until:
                self.lent.remove((at, blocks))
                self.kids.send(self.kids.decode, ("audit_lent", blocks))
        for at, kind in list(self.pending_attacks):
            if now >= at:
                self.pending_attacks.remove((at, kind))
                self.attack(kind)

    def _on_message(self, p: Proc, msg: tuple[Any, ...]) -> None:  # noqa: C901
        kind = msg[0]
        if kind == "faults":
            self.faults.update(msg[1])
        elif kind == "stream_end":
            self.stream_ranges += msg[2]
            self.mid_stream_aborted += int(msg[3])
        elif kind == "released" and p is self.kids.prefill:
            _, rid, _ok, reason, failure, blocks = msg
            self.book.on_released(p.gen, rid, reason, failure, blocks)
        elif kind == "result" and p is self.kids.decode:
            _, rid, ok, reason, failure, blocks, wrong, known = msg
            self.book.on_result(p.gen, rid, ok, reason, failure, blocks, wrong, known)
        elif kind == "stale":
            self.book.on_stale(msg[1], msg[2], msg[3])
        elif kind == "lent_audit":
            _, dirty, blocks = msg
            if dirty:
                self.cross_peer_writes += 1
                self.book.log.append(f"cross-peer registration wrote {dirty} bytes into lent blocks {blocks}")
            self.book.d_alloc.free(blocks)
        elif kind == "held_attack":
            _, what, nframes, accepted, blocks = msg
            self.attacks[what] += nframes
            self.huge_tp_accepted += accepted
            if blocks:
                self.lent.append((time.monotonic() + CROSS_AUDIT_S, blocks))
        elif kind == "captured":
            self.captured, self.captures = msg[1], self.captures + 1
        elif kind == "attacked":
            _, what, nframes, accepted = msg
            self.attacks[what] += nframes
            if accepted:  # harmless unless it had an effect (counted where the effect shows)
                self.hello_answers += accepted
                self.book.log.append(f"attacker's {what} frames got {accepted} Hello answer(s)")

    # -- requests and faults -----------------------------------------------------------------------
    def start_request(self, i: int) -> bool:
        assert self.kids.prefill is not None and self.kids.decode is not None
        n = self.rng.randint(16, self.args.max_tokens)
        rid = f"req-{i}"
        p_blocks = self.book.open(rid, n, i + 1, self.kids.prefill.gen)
        if p_blocks is None:
            return False
        r = self.book.reqs[rid]
        prefill_cmd = self._prefill_cmd(r, p_blocks)
        if self.rng.random() < 0.5:
            self._expect(r)
            self.kids.send(self.kids.prefill, prefill_cmd)
        else:
            self.kids.send(self.kids.prefill, prefill_cmd)
            self._expect(r)
        return True

    def _prefill_cmd(self, r: Req, p_blocks: list[int]) -> tuple[object, ...]:
        """The prefill's command for a new request: its shape (whole or streamed, --stream-share) and, for
        an owed abort_mid_stream, after how many steps the prefill aborts it (a layer stream: 4 ranges)."""
        abort_after = -1
        if self.mid_stream_owed:
            self.mid_stream_owed -= 1
            self.faults["abort_mid_stream"] += 1
            r.shape, abort_after = "layers", self.stream_rng.randint(1, 4)
        elif self.stream_rng.random() < self.args.stream_share:
            r.shape = self.stream_rng.choice(STREAMED)
        return ("prefill", r.rid, p_blocks, r.n, r.tag, r.shape, abort_after)

    def _expect(self, r: Req) -> bool:
        assert self.kids.decode is not None
        blocks = self.book.lend_decode(r, self.kids.decode.gen)
        if blocks is None:
            return False
        self.kids.send(self.kids.decode, ("expect", r.rid, blocks, r.n, r.tag))
        return True

    def inject(self, kind: str) -> bool:  # noqa: C901
        """Inject one fault; False if it found nothing to act on (no live target, no free blocks)."""
        prefill, decode = self.kids.prefill, self.kids.decode
        assert prefill is not None and decode is not None
        live = self.book.live()
        if kind in ("kill_prefill", "kill_decode"):
            role = "prefill" if kind == "kill_prefill" else "decode"
            self.kids.restart(role, lambda gen: self.book.reclaim(role, gen))
        elif kind in ("stop_prefill", "stop_decode"):
            if not self._stop(prefill if kind == "stop_prefill" else decode):
                return False
        elif kind == "abort_decode":
            cands = [r for r in live if r.d_held]
            if not cands:
                return False
            self.kids.send(decode, ("abort", self.rng.choice(cands).rid))
        elif kind == "abort_prefill":
            cands = [r for r in live if r.p_gen >= 0]
            if not cands:
                return False
            self.kids.send(prefill, ("abort", self.rng.choice(cands).rid))
        elif kind == "resend":
            cands = [r for r in live if r.last_blocks in r.d_held]
            if not cands or not self._expect(self.rng.choice(cands)):
                return False
        elif kind == "reset_side_channel":
            self.relay.reset()
            if not self.heal_at and self.rng.random() < 0.5:  # and nothing gets through for a while
                self.relay.blackhole = True
                self.heal_at = time.monotonic() + self.rng.uniform(0.2, 2.0)
        elif kind == "abort_mid_stream":
            self.mid_stream_owed += 1  # counted when the next request carries it (_prefill_cmd)
            return True
        elif kind == "long_prompt":
            if not self._long_prompt():
                return False
        elif kind in ("cross_peer", "huge_tp"):
            if not self._holder_attack(kind):
                return False
        else:
            self.attack(kind)
            return True
        self.faults[kind] += 1
        return True

    def _long_prompt(self) -> bool:
        """An extra request of many blocks (a quarter of the decode's pool)."""
        assert self.kids.prefill is not None
        n = self.book.d_geo.num_blocks * self.book.d_geo.block_size // 4
        rid = f"long-{len(self.long_prompts)}"
        p_blocks = self.book.open(rid, n, 60_000 + len(self.long_prompts), self.kids.prefill.gen)
        if p_blocks is None:
            return False
        self.long_prompts.append(rid)
        r = self.book.reqs[rid]
        self._expect(r)
        self.kids.send(self.kids.prefill, self._prefill_cmd(r, p_blocks))
        return True

    def _holder_attack(self, kind: str) -> bool:
        """A key holder's attack (cross_peer needs two live requests and blocks to lend it)."""
        assert self.kids.attacker is not None
        self.capture()
        targets: list[tuple[str, int]] = []
        blocks: list[int] = []
        if kind == "cross_peer":
            live = [r for r in self.book.live() if r.d_held]
            if len(live) < 2:
                return False
            a, b = self.rng.sample(live, 2)
            need = -(-a.n // self.book.d_geo.block_size)
            if not self.book.d_alloc.can_allocate(need):
                return False
            blocks = self.book.d_alloc.allocate(need)
            targets = [(a.rid, a.n), (b.rid, b.n)]
        self.kids.send(self.kids.attacker, ("holder", kind, targets, blocks, self.captured))
        return True

    def _stop(self, p: Proc) -> bool:
        """SIGSTOP a child, sometimes past the peer timeout; False if it is stopped already."""
        if p.stopped_until:
            return False
        cfg = soak_config("x", 0)
        span = self.rng.uniform(0.1, 2.5 * cfg.liveness.peer_timeout_s)
        is_decode = p is self.kids.decode
        if is_decode:
            self.capture()
        self.kids.freeze(p, span)
        if is_decode and span > cfg.liveness.peer_timeout_s + 0.5 and self.rng.random() < 0.7:
            # the victim looks gone: try its captured Hello now, when a rebind would be accepted
            self.pending_attacks.append((time.monotonic() + cfg.liveness.peer_timeout_s + 0.2, "replayed"))
        return True

    def attack(self, kind: str) -> None:
        assert self.kids.decode is not None and self.kids.attacker is not None
        self.capture()
        live = [r for r in self.book.live() if r.d_held and (kind != "self_check" or r.p_gen >= 0)]
        target = self.rng.choice(live) if live else None
        if target is not None:
            target.attacked = True
        blocks = self.book.d_alloc.free_ids()[: self.rng.randint(1, 4)]
        rid = target.rid if target else "req-0"
        self.kids.send(self.kids.attacker, ("attack", kind, rid, blocks, self.captured))
        self.faults[kind] += 1

    def capture(self) -> None:
        """The decode's latest sent frames (the last capture is kept while the decode is stopped)."""
        assert self.kids.decode is not None
        if self.kids.decode.stopped_until:
            return
        self.kids.send(self.kids.decode, ("capture",))
        seen, deadline = self.captures, time.monotonic() + 1.0
        while self.captures == seen and time.monotonic() < deadline:
            self.pump(0.02)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = self.book.t0 = time.monotonic()
        self.kids.start()
        n = self.args.requests
        schedule = self._schedule(n)
        owed: list[str] = []  # scheduled kinds that have never fired: they found no target at their turn
        i = 0
        while i < n:
            self.pump(0.002)
            if len(self.book.live()) >= self.args.window:
                continue
            if not self.start_request(i):
                continue
            owed = self._inject_due(schedule.get(i, []), owed)
            i += 1
        self._drain()
        return self._report(time.monotonic() - t0)

    def _inject_due(self, due: list[str], owed: list[str]) -> list[str]:
        """Inject this request's faults, and retry the owed ones; returns what is still owed.

        Every kind must fire once per run, but some need a state the run may not be in at their one turn
        (cross_peer needs two live requests and free decode blocks). A kind that never fired is tried again
        at each later request until it fires; extra injections of a kind that already fired are not."""
        still: list[str] = []
        for kind in owed + [k for k in due if k not in owed]:
            if not self.inject(kind) and self.faults[kind] == 0 and kind not in still:
                still.append(kind)
        return still

    def _schedule(self, n: int) -> dict[int, list[str]]:
        """Every kind at least once (spread over the run), then more at random: faults at random points."""
        out: dict[int, list[str]] = {}
        if self.check == "unauthorized":  # self-check: a key holder's abort, a few times
            for k in range(6):
                out.setdefault(int(n * (0.2 + 0.1 * k)), []).append("self_check")
        kinds = [k for k in DRIVER_FAULTS if k in self.kinds]
        if not kinds:
            return out
        self.rng.shuffle(kinds)
        for k, kind in enumerate(kinds):
            at = int(n * (0.05 + 0.85 * (k + self.rng.random()) / len(kinds)))
            out.setdefault(min(at, n - 1), []).append(kind)
        for i in range(n):
            if self.rng.random() < self.args.fault_rate:
                out.setdefault(i, []).append(self.rng.choice(kinds))
        return out

    def _drain(self) -> None:
        """Let every lease, fence and stop pass; then every block must be back."""
        cfg = soak_config("x", 0)
        bound = cfg.leases.ready_timeout_s + cfg.leases.write_bound_s + 2 * cfg.liveness.peer_timeout_s + 5.0
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and (self.book.live() or self.pending_attacks or self.lent):
            self.pump(0.02)
        self.relay.heal()
        self.kids.thaw_all()
        self.pump(0.05)
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and self.book.live():
            self.pump(0.02)
        for r in self.book.live():
            self.book.log.append(f"still held at the end: {r.rid} prefill gen {r.p_gen}, decode {r.d_held}")

    def _kept_at_rest(self) -> dict[str, dict[str, int]]:
        """What each engine's transfer thread still keeps per request (kvpush/endpoint/kept.py), asked
        until every map is empty or a lease and a fence have passed: only non-zero maps are returned."""
        cfg = soak_config("x", 0)
        deadline = time.monotonic() + 2 * cfg.leases.lease_s + cfg.leases.write_bound_s + 2.0
        kept: dict[str, dict[str, int]] = {}
        while True:
            for role, proc in (("prefill", self.kids.prefill), ("decode", self.kids.decode)):
                reply = self.kids.ask(proc, ("kept",)) if proc is not None else None
                kept[role] = {k: v for k, v in (reply[1] if reply else {"no_answer": 1}).items() if v}
            if not any(kept.values()) or time.monotonic() >= deadline:
                break
            self.pump(0.2)
        for role, maps in kept.items():
            if maps:
                self.book.log.append(f"{role}'s transfer thread still keeps per-request state: {maps}")
        return kept

    def _report(self, elapsed: float) -> dict[str, Any]:
        """Ask both engines for their counters and the decode for an audit of its free blocks."""
        kids, book = self.kids, self.book
        assert kids.prefill is not None and kids.decode is not None
        kept = self._kept_at_rest()
        p_reply = kids.ask(kids.prefill, ("stats",)) or ("stats", {}, -1)
        d_reply = kids.ask(kids.decode, ("stats",)) or ("stats", {}, -1)
        audit = kids.ask(kids.decode, ("audit", book.d_alloc.free_ids()))
        end_dirty = int(audit[1]) if audit else 0
        if end_dirty and audit:
            book.log.append(f"{end_dirty} non-zero bytes in the decode's free blocks at the end")
            for b in audit[2][:8]:
                book.log.append(f"  dirty block {b}, last returned by {book.d_history.get(b, '?')}")
        book.stale += end_dirty
        if self.check == "leak" and book.p_alloc.num_free:
            book.p_alloc.lose()  # self-check: the driver loses one block
        return build_report(self, elapsed, p_reply, d_reply, kept)

    def close(self) -> None:
        self.kids.close()
        self.relay.close()
