"""The soak driver's child processes: start, kill, freeze and thaw them, and pump their messages.

Kept apart from what the messages mean (the driver's `on_message`), so the process mechanics (spawn
context, generations, SIGSTOP/SIGCONT, a clean shutdown whatever state a child is in) read in one place."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from kvpush.apps.demo.procs import Geometry
from kvpush.apps.soak.common import KEY
from kvpush.apps.soak.procs import attacker_main, decode_main, prefill_main


@dataclass
class Proc:
    proc: Any
    conn: Connection
    gen: int  # the role's incarnation: 0 first, +1 per restart
    up: bool = False
    address: tuple[str, int] | None = None
    stopped_until: float = 0.0  # SIGSTOPped until then (0: running)
    bye: bool = False


class Children:
    """The prefill, the decode and the attacker, each behind a pipe.

    `on_message(proc, msg)` gets every message a child sends; `on_tick()` runs after each pump, so work
    the driver scheduled (a delayed attack) happens even while it waits for a child."""

    def __init__(
        self,
        p_geo: Geometry,
        d_geo: Geometry,
        port: int,
        rates: dict[str, float],
        seed: int,
        check: str,
        on_message: Callable[[Proc, tuple[Any, ...]], None],
        on_tick: Callable[[], None],
    ) -> None:
        self.p_geo, self.d_geo, self.port, self.rates = p_geo, d_geo, port, rates
        self.dial_port = port  # where the decode dials the prefill (the driver's relay, when it has one)
        self.seed, self.check = seed, check
        self.on_message, self.on_tick = on_message, on_tick
        self.ctx = mp.get_context("spawn")
        self.gens = Counter[str]()
        self.replies: dict[tuple[int, str], tuple[Any, ...]] = {}
        self.prefill: Proc | None = None
        self.decode: Proc | None = None
        self.attacker: Proc | None = None

    def all(self) -> list[Proc]:
        return [p for p in (self.prefill, self.decode, self.attacker) if p is not None]

    def start(self) -> None:
        """The attacker, then the prefill, then the decode (which connects to the prefill)."""
        self.attacker = self.spawn("attacker")
        self.prefill = self.spawn("prefill")
        self.wait_up(self.prefill)
        self.decode = self.spawn("decode")
        self.wait_up(self.decode)

    def spawn(self, role: str) -> Proc:
        parent, child = self.ctx.Pipe()
        gen = self.gens[role]
        self.gens[role] += 1
        seed = self.seed * 1000 + 10 * gen + (1 if role == "decode" else 0)
        if role == "prefill":
            target: Any = prefill_main
            args: tuple[Any, ...] = (child, self.p_geo, self.port, self.rates, seed, self.check)
        elif role == "decode":
            target = decode_main
            prefill = ("127.0.0.1", self.dial_port, self.p_geo.tp_size)
            args = (child, self.d_geo, prefill, self.rates, seed, self.check)
        else:
            target = attacker_main
            args = (child, self.port, KEY if self.check == "unauthorized" else None, KEY)
        proc = self.ctx.Process(target=target, args=args, name=f"kvpush-soak-{role}", daemon=True)
        proc.start()
        child.close()
        return Proc(proc, parent, gen, up=role == "attacker")

    def wait_up(self, p: Proc, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not p.up:
            if time.monotonic() > deadline or not p.proc.is_alive():
                raise RuntimeError(f"{p.proc.name} did not come up")
            self.pump(0.02)

    def kill(self, p: Proc) -> None:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(p.proc.pid, signal.SIGCONT)
            os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.join(10)
        with contextlib.suppress(OSError):
            p.conn.close()

    def restart(self, role: str, reclaim: Callable[[int], None]) -> None:
        """SIGKILL, `reclaim(old generation)`, then a new process (the prefill on the same port)."""
        old = self.prefill if role == "prefill" else self.decode
        assert old is not None
        self.kill(old)
        reclaim(old.gen)
        new = self.spawn(role)
        if role == "prefill":
            self.prefill = new
        else:
            self.decode = new
        self.wait_up(new)

    def freeze(self, p: Proc, span: float) -> None:
        """SIGSTOP `p` for `span` seconds (a pump sends the SIGCONT)."""
        os.kill(p.proc.pid, signal.SIGSTOP)
        p.stopped_until = time.monotonic() + span

    def thaw_all(self) -> None:
        """Every stopped child is due now (the drain does not wait out a long stop)."""
        for p in (self.prefill, self.decode):
            if p is not None and p.stopped_until:
                p.stopped_until = time.monotonic()

    def send(self, p: Proc, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):
            p.conn.send(msg)

    def pump(self, timeout: float) -> None:
        """Deliver every pending message (waiting up to `timeout` for one), then thaw due children."""
        procs = self.all()
        conns = [p.conn for p in procs if not p.conn.closed]
        for ready in wait(conns, timeout):
            p = next(x for x in procs if x.conn is ready)
            conn = p.conn
            try:
                while conn.poll():
                    self._deliver(p, conn.recv())
            except (EOFError, OSError):
                p.bye = True
        now = time.monotonic()
        for q in (self.prefill, self.decode):
            if q is not None and q.stopped_until and now >= q.stopped_until:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(q.proc.pid, signal.SIGCONT)
                q.stopped_until = 0.0
        self.on_tick()

    def _deliver(self, p: Proc, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "up":
            p.up, p.address = True, msg[1]
        elif kind in ("stats", "audit", "kept"):
            self.replies[(p.gen, kind)] = msg
        elif kind == "bye":
            p.bye = True
        else:
            self.on_message(p, msg)

    def ask(self, p: Proc, msg: tuple[Any, ...], timeout: float = 10.0) -> tuple[Any, ...] | None:
        """Send a query to a child and wait for its answer of the same kind (other messages go on)."""
        self.replies.pop((p.gen, msg[0]), None)
        self.send(p, msg)
        deadline = time.monotonic() + timeout
        while (p.gen, msg[0]) not in self.replies and time.monotonic() < deadline:
            self.pump(0.02)
        return self.replies.pop((p.gen, msg[0]), None)

    def close(self) -> None:
        """Every child goes, whatever happened: SIGCONT (a stopped one cannot exit), stop, then SIGKILL."""
        for p in self.all():
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p.proc.pid, signal.SIGCONT)
            self.send(p, ("stop",))
        for p in self.all():
            p.proc.join(10)
            if p.proc.is_alive():
                self.kill(p)
