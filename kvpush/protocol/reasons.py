"""Why a request failed, as a small closed set: carried on the state machines' actions, on the wire (a
prefill's TransferFailed names its kind) and on the endpoints' results beside the human-readable reason,
and used as the metrics' `reason` label (never the text)."""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    EXPIRED = "expired"  # a lease or a registration expired before the WRITE could start
    TIMEOUT = "timeout"  # a WRITE, or the decode's wait for its KV, ran past its time
    ABORTED = "aborted"  # an engine aborted or cancelled the request (either side)
    PEER_GONE = "peer_gone"  # the other side is proven gone, replaced, closed, or unreachable
    PEER_SILENT = "peer_silent"  # the other side stopped answering (maybe frozen): fence-bound
    CLOSED = "closed"  # this endpoint closed, or its transfer thread died
    WRITE_FAILED = "write_failed"  # the data plane failed a WRITE (or could not post it)
    SUPERSEDED = "superseded"  # a newer attempt of the request replaced this one
    REFUSED = "refused"  # the request cannot be served as asked (TP, token count, limits, identity)
    REMOTE = "remote"  # the prefill reported a failure without its kind (a peer from before kinds travelled)


def received(kind: Failure, abandoned: bool) -> Failure:
    """The kind a decode gives a failure its prefill reported as `kind` (TransferFailed.kind): the same,
    except that a prefill's own CLOSED is, seen from the decode, its peer gone (CLOSED on a result means
    this endpoint closed), and an old peer's kindless notice of an abandoned WRITE is a TIMEOUT."""
    if kind is Failure.CLOSED:
        return Failure.PEER_GONE
    if kind is Failure.REMOTE and abandoned:
        return Failure.TIMEOUT
    return kind
