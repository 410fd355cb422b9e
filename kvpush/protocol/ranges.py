"""Streamed push: which part of a request's KV is ready and not yet sent to a decode rank, as ranges.

The engine reports progress as "the first n tokens of these layers are computed" (`kv_ready`), so what is
ready is one token count per layer (a frontier), and what a decode rank has been sent is another. The
difference, cut into ranges of (token interval x layer interval), is what may be posted next. Adjacent
layers with the same interval form one range, so ranges reported one after another before the
registration arrived (or while a WRITE was in flight) coalesce into one WRITE.

A range may start only at a token where both sides' block tables start a block (`align`: the lcm of the
two block sizes), so every range but the last ends on such a token too; the rest waits for more tokens
or for prefill_done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """Tokens [t0, t1) of layers [l0, l1)."""

    t0: int
    t1: int
    l0: int
    l1: int

    def units(self) -> int:
        """Token-layers it covers (times a rank's bytes per token-layer: its bytes)."""
        return (self.t1 - self.t0) * (self.l1 - self.l0)


@dataclass(frozen=True)
class StreamPolicy:
    """When a range may move before prefill_done: the request has at least `min_tokens` tokens ready, and
    the range is at least `min_bytes` (estimated with `token_layer_bytes`, a rank's bytes per token per
    layer). Below that a range waits and coalesces with later ones, and a short request moves in one piece
    at prefill_done: a WRITE costs a fixed amount that a small range does not earn back."""

    min_tokens: int = 0
    min_bytes: int = 0
    token_layer_bytes: int = 0

    def early(self, r: Range, ready_tokens: int) -> bool:
        return ready_tokens >= self.min_tokens and r.units() * self.token_layer_bytes >= self.min_bytes


def pending_ranges(ready: Sequence[int], sent: Sequence[int], target: int, align: int) -> list[Range]:
    """Ranges ready for a rank that needs `target` tokens and has been sent `sent` (per layer)."""
    n = len(ready)
    if n and n == len(sent) and ready.count(ready[0]) == n and sent.count(sent[0]) == n:
        # one frontier for every layer (a request moved in one piece, or every layer reported alike):
        # the loop below would give one range over all layers; found without building one per layer
        hi, done = min(ready[0], target), sent[0]
        if hi < target:
            hi -= hi % align
        return [Range(done, hi, 0, n)] if hi > done else []
    return per_layer_ranges(ready, sent, target, align)


def per_layer_ranges(ready: Sequence[int], sent: Sequence[int], target: int, align: int) -> list[Range]:
    """pending_ranges layer by layer (any frontiers)."""
    out: list[Range] = []
    for layer, (have, done) in enumerate(zip(ready, sent, strict=True)):
        hi = min(have, target)
        if hi < target:
            hi -= hi % align
        if hi <= done:
            continue
        last = out[-1] if out else None
        if last is not None and last.l1 == layer and (last.t0, last.t1) == (done, hi):
            out[-1] = Range(done, hi, last.l0, layer + 1)
        else:
            out.append(Range(done, hi, layer, layer + 1))
    return out
