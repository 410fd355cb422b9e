"""The soak's TP pieces without processes: the --tp flag, a relay that forwards one port per prefill
rank, and the per-rank results an engine gathers before the driver hears of a request."""

from __future__ import annotations

import argparse
import socket
import threading

import pytest

from kvpush.apps.ports import free_port_range
from kvpush.apps.soak.cli import _tp
from kvpush.apps.soak.procs import _RankResults
from kvpush.apps.soak.relay import Relay
from kvpush.protocol.reasons import Failure


def test_tp_flag_takes_p_colon_d_and_names_what_is_wrong():
    assert _tp("2:1") == (2, 1) and _tp("1:2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="expected P:D"):
        _tp("2")
    with pytest.raises(argparse.ArgumentTypeError, match="must be 1 or 2"):
        _tp("4:1")


def test_a_request_is_reported_once_every_rank_gave_its_result_failed_if_any_rank_failed():
    got = _RankResults(2)
    assert got.add("a", (1, 2), True, "") is None
    assert got.add("b", (3,), False, "rank 0 gave up", Failure.TIMEOUT) is None
    assert got.add("a", (1, 2), True, "") == (True, "", None)
    assert got.add("b", (3,), True, "") == (False, "rank 0 gave up", Failure.TIMEOUT)
    # a resend of "a" into other blocks is another request to gather
    assert got.add("a", (5,), True, "") is None and not got.got.keys() - {("a", (5,))}


def _echo_server(port: int, tag: bytes) -> socket.socket:
    server = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while len(data) < 2 and (part := conn.recv(64)):
                data += part
            conn.sendall(tag + data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_relay_for_two_ranks_forwards_each_port_to_its_rank():
    target = free_port_range(2)
    servers = [_echo_server(target + r, f"rank{r}:".encode()) for r in range(2)]
    relay = Relay(target, ranks=2, listen_port=free_port_range(2))
    try:
        for r in range(2):
            with socket.create_connection(("127.0.0.1", relay.port + r), timeout=5) as c:
                c.sendall(b"hi")
                want, got = f"rank{r}:hi".encode(), b""
                while len(got) < len(want) and (part := c.recv(64)):
                    got += part
                assert got == want
        with pytest.raises(ValueError, match="listen_port"):
            Relay(target, ranks=2)
    finally:
        relay.close()
        for s in servers:
            s.close()
