"""`kvpush proxy`'s settings: the backends, the dispatch mode, pairing, timeouts and client-facing limits."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .pairing import PrefillBackend


class ProxyMode(str, enum.Enum):
    """How a request is dispatched: push sends it to prefill and decode at once (kvpush, vLLM's
    NixlPushConnector); pull sends it to the prefill first, then its kv_transfer_params to the decode
    (vLLM's NixlConnector)."""

    PUSH = "push"
    PULL = "pull"

    def __str__(self) -> str:
        return self.value


_POSITIVE = (
    "max_body_bytes",
    "body_timeout_s",
    "max_json_depth",
    "max_request_id_len",
    "max_connections",
    "idle_timeout_s",
    "write_timeout_s",
    "timings_max_records",
    "backend_keepalive_s",
)


@dataclass
class ProxyConfig:
    """What `kvpush proxy` is told (cli.config_from_args builds it from the flags)."""

    prefill: list[PrefillBackend]
    decode: list[str]
    mode: ProxyMode = ProxyMode.PUSH  # a plain "push" / "pull" is taken too
    # per decode: base URL of its kvpush pairing check ("" = none; vLLM's own connectors have none)
    decode_pairing: list[str] = field(default_factory=list)
    # per decode: its engine_id ("" = learn it from its pairing check's answer). Sent with the prefill leg
    # (kv_transfer_params.decode_engine_id), so the prefill lets only that engine register for the push
    decode_engine_ids: list[str] = field(default_factory=list)
    # the shared key of keyed decodes: signs each pairing check (params.PAIRING_HEADER); never shown
    pairing_key: bytes | None = field(default=None, repr=False)
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    # An idle connection to a backend is reused for at most this long. It must stay below the backends'
    # own keep-alive (vLLM closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default):
    # a request written on a connection the server is closing is lost (ServerDisconnectedError, a 502),
    # and aiohttp retries no POST. aiohttp's own default is 15 s.
    backend_keepalive_s: float = 4.0
    # Client-facing limits (server.py). A body: at most max_body_bytes, all of it within
    # body_timeout_s, nested at most max_json_depth deep. Connections: at most max_connections, idle
    # ones (or ones still sending headers) closed after idle_timeout_s.
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0
    max_json_depth: int = 64
    max_request_id_len: int = 128
    max_connections: int = 1024
    idle_timeout_s: float = 30.0
    # a streamed answer's write to the client must finish within this, or the client is dropped
    write_timeout_s: float = 60.0
    # GET /kvpush/timings: off while empty; else served only with this bearer token, at most
    # timings_max_records records.
    timings_token: str = ""
    timings_max_records: int = 10_000
    # counters the router adds to (requests, errors, released)
    stats: dict[str, int] = field(default_factory=lambda: {"requests": 0, "errors": 0, "released": 0})

    def __post_init__(self) -> None:
        try:
            self.mode = ProxyMode(self.mode)
        except ValueError:
            raise ValueError(f"mode must be 'push' or 'pull', got {self.mode!r}") from None

    def check(self) -> None:
        """ValueError naming the first setting the proxy cannot run with."""
        if not self.prefill or not self.decode:
            raise ValueError("the proxy needs at least one prefill and one decode backend")
        if self.decode_pairing and len(self.decode_pairing) != len(self.decode):
            raise ValueError(
                f"decode_pairing has {len(self.decode_pairing)} entries for {len(self.decode)} decode backends"
            )
        if self.decode_engine_ids and len(self.decode_engine_ids) != len(self.decode):
            raise ValueError(
                f"decode_engine_ids has {len(self.decode_engine_ids)} entries for {len(self.decode)} decode "
                "backends"
            )
        for name in _POSITIVE:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
