"""`kvpush soak`: a chaos soak of the push path over real NIXL, with figures that can fail.

Three real processes on 127.0.0.1 besides this driver: a prefill and a decode engine (each one endpoint per
TP rank over NIXL/UCX with a HostKVCache, `--tp P:D`, both keyed with the same HMAC secret; a request is
the driver's once every rank of an engine finished it) and an attacker that holds no key. The
driver owns every block pool and hands block tables (fragmented: shuffled runs from `BlockPool`; book.py) to
the engines; it gets each block back only when the owning endpoint reports the request finished, or when the
process that held it is killed (its memory died with it). Faults come at random points from a seeded RNG:
SIGKILL and restart (the prefill on the same port), SIGSTOP/SIGCONT (sometimes past the peer timeout),
dropped / duplicated / reordered notifications and slow WRITEs (`FaultInjectingTransport` from
kvpush/transport/faults.py around NixlTransport inside the engines), aborts on both sides, resends with a
new attempt, and forged, replayed and hijacking frames from the attacker (raw ZeroMQ DEALER; replays come
from `FrameTapControl` in tap.py, which copies what the decode sends, as an eavesdropper would).

What is checked, and why each check can fail: the decode compares every byte of every request it
declares ready with the pattern the prefill wrote (corrupt_bytes); it scrubs blocks to zero when it
hands them back and counts non-zero bytes when it gets them again and at the end (stale_writes: a WRITE
that landed after the blocks were freed); the pools must be whole at the end (leaked_blocks_*); an
attacker frame that got a Hello answer, or an honest request that ended for the attacker's reason,
counts as unauthorized_accepted. At the end both engines' transfer threads must keep no per-request
state (kept_state_at_end, `Endpoint.kept_state()`). `--self-check` breaks the harness on purpose so each
counter is seen to rise.

The package, in reading order: cli.py (the flags), driver.py (`Soak`: requests and faults), book.py (the
pools and who holds each block), children.py (the processes and their pipes), procs.py (the engines'
and the attacker's entry points), attacker.py, tap.py, report.py (failure kinds, FAIL_ON, the table).
"""

from kvpush.apps.soak.common import FAULT_KINDS as FAULT_KINDS
from kvpush.apps.soak.report import FAIL_ON as FAIL_ON
from kvpush.apps.soak.tap import FrameTapControl as FrameTapControl
