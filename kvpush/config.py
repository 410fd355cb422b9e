"""One typed configuration object for both sides.

It is filled from CLI flags, from vLLM's kv_connector_extra_config, or in code; `from_mapping` refuses
unknown keys and wrong types with a message that names the key, so a typo in a deployment's JSON fails at
start-up rather than being silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from .errors import ConfigError

MIN_KEY_BYTES = 16  # as kvpush.protocol.handshake.MIN_KEY_BYTES (config must not import the protocol)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class KVPushConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    engine_id: str = "kvpush"
    # Side channel (metadata handshake and registrations). Never 0.0.0.0 unless asked for.
    host: str = "127.0.0.1"
    port: int = 5600  # a rank listens on port + tp_rank
    # NIXL
    backends: tuple[str, ...] = ("UCX",)
    ucx_net_devices: str | None = "lo"  # None leaves UCX_NET_DEVICES alone (clusters)
    # NIXL backend init parameters, e.g. {"LIBFABRIC": {"num_threads": 4, "striping_threshold": 131072}}
    # (passed as strings). The environment variable KVPUSH_BACKENDS overrides `backends` at transport
    # start (kvpush.transport.nixl.selected_backends).
    backend_params: dict[str, dict[str, str | int | float | bool]] = msgspec.field(default_factory=dict)
    # Prefill: how long source blocks wait for a registration (or a registration for its prefill)
    # before the request fails and the blocks are released.
    lease_s: float = 120.0
    # Decode: how long after expect() the KV must be ready. Longer than the lease, so a prefill that
    # gives up always tells decode first.
    ready_timeout_s: float = 150.0
    # How long finished request ids are remembered to recognise late duplicates.
    tombstone_s: float = 300.0
    # Push/poll thread pacing. While work is in flight or expected, the thread sleeps busy_poll_s between
    # rounds, doubling up to max_busy_poll_s while nothing happens (a decode waiting through a long
    # prefill must not spin a core), and back to busy_poll_s on any activity. Idle: idle_poll_s.
    busy_poll_s: float = 50e-6
    max_busy_poll_s: float = 1e-3
    idle_poll_s: float = 0.02
    handshake_timeout_s: float = 10.0
    # Posting. post_workers 0: the push thread posts and polls every WRITE itself; N > 0: N posting threads
    # share the NIXL agent (STRICT sync), each destination kept on one worker while it has WRITEs in
    # flight (its posts stay in order). Measured on a 2-core box over UCX loopback, where the copy runs
    # inside the post, workers do not help (numbers in kvpush/transport/posting.py): the default is 0.
    # On a 16-core host with RDMA or cuda_ipc and several decode ranks per prefill rank, try 2-4 (the
    # demo's --post-workers measures it there). Whatever the mode, at
    # most max_inflight_bytes and max_inflight_descriptors are posted and unsettled at once (a WRITE
    # larger than either still goes when nothing else is in flight); the rest wait in one FIFO queue per
    # destination, and destinations take turns.
    post_workers: int = 0
    max_inflight_bytes: int = 4 << 30
    max_inflight_descriptors: int = 1 << 18
    # Prefill: after posting a WRITE, tell the decode on the side channel (a Posted nudge), so the decode
    # polls NIXL notifications at busy_poll_s without backing off until that WRITE's notification lands
    # (with UCX the notification leaves when the prefill polls, and the decode finds it on its next poll).
    posted_nudge: bool = True
    max_message_bytes: int = 1 << 20
    # Fencing. A registration expires at its ready deadline (expect() + ready_timeout_s); the prefill never
    # posts after that, abandons a WRITE write_timeout_s after posting it, and write_linger_s bounds how
    # late an abandoned WRITE's bytes may still land. The decode hands blocks back once no WRITE can land:
    # on news that rules it out, or at expiry + write_timeout_s + write_linger_s.
    write_timeout_s: float = 10.0
    write_linger_s: float = 1.0
    # Liveness on the side channel: each side pings every ping_interval_s; a peer not heard from for
    # peer_timeout_s is silent (its requests end, and the decode re-handshakes to find a restart).
    ping_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    # Authentication: a shared secret of at least 16 bytes, the same on both sides. require_auth None means
    # "required when listening beyond loopback"; True always; False never (explicitly unauthenticated).
    hmac_key: bytes | None = None
    require_auth: bool | None = None
    # Prefill: decode engine ids allowed to handshake (empty: any).
    allowed_decode_ids: tuple[str, ...] = ()
    # Prefill: per decode rank, at most this many pending registrations and bytes of their block tables.
    max_pending_per_peer: int = 4096
    max_pending_bytes_per_peer: int = 64 << 20
    # Per connection and loop round, at most this many side-channel messages (others wait a round).
    max_messages_per_peer_round: int = 16
    # Optional Prometheus HTTP endpoint (prometheus_client.start_http_server); None: off.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ConfigError("engine_id must be a non-empty string")
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port {self.port} is out of range 0..65535")
        for name in (
            "lease_s",
            "ready_timeout_s",
            "tombstone_s",
            "busy_poll_s",
            "max_busy_poll_s",
            "idle_poll_s",
            "handshake_timeout_s",
            "write_timeout_s",
            "write_linger_s",
            "ping_interval_s",
            "peer_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ready_timeout_s <= self.lease_s:
            raise ConfigError(
                f"ready_timeout_s ({self.ready_timeout_s}) must exceed lease_s ({self.lease_s}) so that "
                "prefill reports a give-up before decode times out"
            )
        if self.max_busy_poll_s < self.busy_poll_s:
            raise ConfigError(
                f"max_busy_poll_s ({self.max_busy_poll_s}) must be >= busy_poll_s ({self.busy_poll_s})"
            )
        if not self.backends:
            raise ConfigError("backends must name at least one NIXL backend, e.g. ['UCX']")
        if self.peer_timeout_s <= self.ping_interval_s:
            raise ConfigError(
                f"peer_timeout_s ({self.peer_timeout_s}) must exceed ping_interval_s ({self.ping_interval_s})"
            )
        if self.hmac_key is not None and len(self.hmac_key) < MIN_KEY_BYTES:
            raise ConfigError(
                f"hmac_key is {len(self.hmac_key)} bytes; a shared key needs at least {MIN_KEY_BYTES} "
                "(e.g. 32 random bytes); an empty or short key is refused"
            )
        if self.require_auth and self.hmac_key is None:
            raise ConfigError("require_auth=True but no hmac_key is set: set the same key on both sides")
        unknown = sorted(set(self.backend_params) - set(self.backends))
        if unknown:
            raise ConfigError(
                f"backend_params names backends {unknown} that are not in backends {list(self.backends)}"
            )
        if not (0 <= self.post_workers <= 64):
            raise ConfigError(f"post_workers must be in 0..64, got {self.post_workers}")
        for name in (
            "max_pending_per_peer",
            "max_pending_bytes_per_peer",
            "max_messages_per_peer_round",
            "max_inflight_bytes",
            "max_inflight_descriptors",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    def check_listen(self) -> None:
        """Before a prefill listens: beyond loopback, authentication is required unless switched off."""
        if self.auth_required and self.hmac_key is None:
            raise ConfigError(
                f"a prefill listening on {self.host!r} (beyond loopback) requires authentication, and no "
                "hmac_key is set: set the same key (>= 16 bytes) on both sides, or require_auth=False to run "
                "unauthenticated on purpose"
            )

    @property
    def auth_required(self) -> bool:
        if self.require_auth is not None:
            return self.require_auth
        return self.host not in LOOPBACK

    @property
    def write_bound_s(self) -> float:
        """How long after a registration's expiry a WRITE of it may still land."""
        return self.write_timeout_s + self.write_linger_s

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> KVPushConfig:
        try:
            return msgspec.convert(dict(data), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid kvpush config: {exc}") from exc

    def replace(self, **changes: Any) -> KVPushConfig:
        return msgspec.structs.replace(self, **changes)
