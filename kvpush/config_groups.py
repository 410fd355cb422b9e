"""The groups of `KVPushConfig`, one frozen struct per concern, each checking its own fields when built.

They change when a concern gains a knob (a new field with its description: docs/config.md is generated from
them); how the groups are put together, the flat keys and the rules that span groups stay in config.py.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .errors import ConfigError
from .keyfile import resolve_key

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "[::]", "*", "")
REDACTED = "<redacted>"


def _positive(group: msgspec.Struct, *names: str) -> None:
    for name in names:
        value = getattr(group, name)
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


class _Group(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the groups: frozen, keyword-only, unknown fields refused."""


class SideChannel(_Group, frozen=True):
    """Where a prefill listens for the metadata handshake and registrations (never 0.0.0.0 unless asked)."""

    host: Annotated[str, Meta(description="Prefill: the address the side channel binds.")] = "127.0.0.1"
    port: Annotated[
        int, Meta(description="Prefill: rank r listens on port + r (0: any free port, for tests).")
    ] = 5600
    advertise_host: Annotated[
        str | None,
        Meta(
            description="Prefill: the address decodes are told to reach it at (null: host); needed when "
            "host is a wildcard such as 0.0.0.0, which is never advertised."
        ),
    ] = None

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port {self.port} is out of range 0..65535")
        if self.advertise_host is not None and self.advertise_host in WILDCARDS:
            raise ConfigError(
                f"advertise_host {self.advertise_host!r} is a wildcard; a decode cannot connect to it: "
                "set the address decodes reach this prefill at (e.g. the node's private IP)"
            )

    @property
    def advertised(self) -> str:
        """The host a decode connects to; ConfigError when only a wildcard bind address is known."""
        if self.advertise_host is not None:
            return self.advertise_host
        if self.host in WILDCARDS:
            raise ConfigError(
                f"host {self.host!r} binds every interface and cannot be advertised: set advertise_host "
                "to the address decodes reach this prefill at"
            )
        return self.host


BackendParams = dict[str, dict[str, str | int | float | bool]]


class Nixl(_Group, frozen=True):
    """The NIXL agent: which backends it creates and how."""

    backends: Annotated[
        tuple[str, ...],
        Meta(description="NIXL backends to create; the environment variable KVPUSH_BACKENDS overrides it."),
    ] = ("UCX",)
    ucx_net_devices: Annotated[
        str | None,
        Meta(
            description='UCX_NET_DEVICES to set if the environment has none (e.g. "lo" for one host); '
            "null: UCX picks the devices that reach the peer."
        ),
    ] = None
    backend_params: Annotated[
        BackendParams,
        Meta(
            description='Backend init parameters, e.g. {"LIBFABRIC": {"num_threads": 4}} (passed as strings).'
        ),
    ] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("backends must name at least one NIXL backend, e.g. ['UCX']")
        unknown = sorted(set(self.backend_params) - set(self.backends))
        if unknown:
            raise ConfigError(
                f"backend_params names backends {unknown} that are not in backends {list(self.backends)}"
            )


class Leases(_Group, frozen=True):
    """How long each side holds blocks, and the fence that says when no WRITE can land any more.

    A registration expires at its ready deadline (expect() + ready_timeout_s); the prefill never posts after
    that and abandons a WRITE write_timeout_s after posting it; write_linger_s bounds how late an abandoned
    WRITE's bytes may still land. The decode hands blocks back once no WRITE can land.
    """

    lease_s: Annotated[
        float,
        Meta(description="Prefill: how long source blocks wait for a registration (or it for the prefill)."),
    ] = 120.0
    ready_timeout_s: Annotated[
        float, Meta(description="Decode: how long after expect() the KV must be ready; > lease_s.")
    ] = 150.0
    tombstone_s: Annotated[
        float, Meta(description="How long finished request ids are remembered to spot late duplicates.")
    ] = 300.0
    write_timeout_s: Annotated[
        float, Meta(description="Prefill: a WRITE not complete this long after posting is abandoned.")
    ] = 10.0
    write_linger_s: Annotated[
        float, Meta(description="How late an abandoned WRITE's bytes may still land.")
    ] = 1.0

    def __post_init__(self) -> None:
        _positive(self, "lease_s", "ready_timeout_s", "tombstone_s", "write_timeout_s", "write_linger_s")
        if self.ready_timeout_s <= self.lease_s:
            raise ConfigError(
                f"ready_timeout_s ({self.ready_timeout_s}) must exceed lease_s ({self.lease_s}) so that "
                "prefill reports a give-up before decode times out"
            )

    @property
    def write_bound_s(self) -> float:
        """How long after a registration's expiry a WRITE of it may still land."""
        return self.write_timeout_s + self.write_linger_s


class Liveness(_Group, frozen=True):
    """Side-channel liveness: a peer not heard from for peer_timeout_s is gone (its requests end)."""

    ping_interval_s: Annotated[float, Meta(description="Each side pings its peers this often.")] = 1.0
    peer_timeout_s: Annotated[
        float,
        Meta(description="A peer silent this long is gone; the decode re-handshakes to find a restart."),
    ] = 5.0
    handshake_timeout_s: Annotated[
        float, Meta(description="Decode: how long connect() waits for a prefill's handshake answer.")
    ] = 10.0

    def __post_init__(self) -> None:
        _positive(self, "ping_interval_s", "peer_timeout_s", "handshake_timeout_s")
        if self.peer_timeout_s <= self.ping_interval_s:
            raise ConfigError(
                f"peer_timeout_s ({self.peer_timeout_s}) must exceed ping_interval_s ({self.ping_interval_s})"
            )


class Pacing(_Group, frozen=True):
    """Push/poll thread pacing: a decode waiting through a long prefill must not spin a core.

    While work is in flight or expected the thread sleeps busy_poll_s between rounds, doubling up to
    max_busy_poll_s while nothing happens, back to busy_poll_s on any activity; idle, idle_poll_s.
    spin_s keeps an idle thread polling a moment longer: a thread woken from a block costs a wake-up and
    runs its next request's Python cold (several times its warm cost on a loaded VM), at the price of CPU.
    """

    busy_poll_s: Annotated[float, Meta(description="Sleep between rounds while work is in flight.")] = 50e-6
    max_busy_poll_s: Annotated[
        float, Meta(description="The busy sleep doubles up to this while nothing happens.")
    ] = 1e-3
    idle_poll_s: Annotated[float, Meta(description="Sleep between rounds with nothing in flight.")] = 0.02
    spin_s: Annotated[
        float,
        Meta(
            description="After any activity, keep polling at busy_poll_s this long before blocking (0: off)."
        ),
    ] = 0.0

    def __post_init__(self) -> None:
        _positive(self, "busy_poll_s", "max_busy_poll_s", "idle_poll_s")
        if not 0.0 <= self.spin_s <= 0.1:
            raise ConfigError(f"spin_s must be within 0..0.1 s, got {self.spin_s}")
        if self.max_busy_poll_s < self.busy_poll_s:
            raise ConfigError(
                f"max_busy_poll_s ({self.max_busy_poll_s}) must be >= busy_poll_s ({self.busy_poll_s})"
            )


class Posting(_Group, frozen=True):
    """How the prefill posts WRITEs.

    workers 0: the push thread posts and polls every WRITE itself; N > 0: N posting threads share the NIXL
    agent, each destination kept on one worker while it has WRITEs in flight (its posts stay in order). On
    a 2-core box over UCX loopback workers do not help (kvpush/endpoint/posting.py), so the default is 0;
    with RDMA or cuda_ipc and several decode ranks per prefill rank try 2-4. At most max_inflight_bytes
    and max_inflight_descriptors are posted and unsettled at once (a larger WRITE still goes alone); the
    rest wait in one FIFO queue per destination, and destinations take turns.
    """

    workers: Annotated[int, Meta(description="Posting threads, 0..64 (0: the push thread posts).")] = 0
    max_inflight_bytes: Annotated[int, Meta(description="Bytes posted and not yet settled, at most.")] = (
        4 << 30
    )
    max_inflight_descriptors: Annotated[
        int, Meta(description="Descriptors posted and not yet settled, at most.")
    ] = 1 << 18
    nudge: Annotated[
        bool,
        Meta(
            description="After posting a WRITE, send the decode a Posted nudge so it polls NIXL "
            "notifications at busy_poll_s until that WRITE lands."
        ),
    ] = True
    engine_post_max_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="prefill_done of a request whose WRITEs were all made ahead (source_blocks), "
            "of at most this many bytes, with no kv_written barrier, posts them from the engine's own "
            "thread when the push thread is between rounds (no thread hop); 0: always hand over.",
        ),
    ] = 1 << 20

    def __post_init__(self) -> None:
        if not (0 <= self.workers <= 64):
            raise ConfigError(f"post_workers (posting.workers) must be in 0..64, got {self.workers}")
        _positive(self, "max_inflight_bytes", "max_inflight_descriptors")


class Streaming(_Group, frozen=True):
    """Streamed push (PrefillEndpoint.kv_ready): a ready range moves before prefill_done only once the
    request has min_tokens tokens ready and the range is at least min_bytes; smaller ranges wait and
    coalesce, and a short request moves in one piece (a WRITE's fixed cost is not earned back)."""

    min_tokens: Annotated[int, Meta(ge=0, description="Ready tokens a request needs to stream.")] = 1024
    min_bytes: Annotated[int, Meta(ge=0, description="Smallest range (this rank's bytes) sent early.")] = (
        1 << 18
    )


class Security(_Group, frozen=True):
    """Authentication and who may pair: a shared secret of at least 16 bytes, the same on both sides.

    The key comes from exactly one of `hmac_key` (base64 in JSON: visible wherever the config is, e.g.
    `ps` and vLLM's start-up log), `hmac_key_file` (a file holding it in base64, not readable by every
    user) or the environment variable KVPUSH_HMAC_KEY (base64, read by `KVPushConfig.from_mapping`, never
    by this constructor); the file or the variable keep it off command lines. repr() and str() never show it.
    """

    hmac_key: Annotated[
        bytes | None,
        Meta(description="The shared key (base64 in JSON); null: from hmac_key_file or $KVPUSH_HMAC_KEY."),
    ] = None
    hmac_key_file: Annotated[
        str | None,
        Meta(description="A file holding the shared key in base64 (not world-readable: chmod 600)."),
    ] = None
    require_auth: Annotated[
        bool | None,
        Meta(description="null: required when listening beyond loopback; true: always; false: never."),
    ] = None
    allowed_decode_ids: Annotated[
        tuple[str, ...], Meta(description="Prefill: decode engine ids allowed to handshake (empty: any).")
    ] = ()

    def __post_init__(self) -> None:
        # the file's key (a copy made by replace already holds it: the same key is no conflict), checked
        msgspec.structs.force_setattr(self, "hmac_key", resolve_key(self.hmac_key, self.hmac_key_file))
        if self.require_auth and self.hmac_key is None:
            raise ConfigError("require_auth=True but no hmac_key is set: set the same key on both sides")

    def __repr__(self) -> str:
        key = None if self.hmac_key is None else REDACTED
        return (
            f"Security(hmac_key={key}, hmac_key_file={self.hmac_key_file!r}, "
            f"require_auth={self.require_auth!r}, allowed_decode_ids={self.allowed_decode_ids!r})"
        )

    __str__ = __repr__


class Limits(_Group, frozen=True):
    """Bounds on what one peer can make this side hold or do (a flood costs the flooder, not the others)."""

    max_message_bytes: Annotated[int, Meta(description="Largest side-channel message accepted.")] = 1 << 20
    max_pending_per_peer: Annotated[
        int,
        Meta(
            description="Prefill: pending registrations per decode rank, at most; also the most "
            "tombstones one decode engine's aborts of ids the prefill has not seen may leave."
        ),
    ] = 4096
    max_pending_bytes_per_peer: Annotated[
        int, Meta(description="Prefill: bytes of pending block tables per decode rank, at most.")
    ] = 64 << 20
    max_messages_per_peer_round: Annotated[
        int, Meta(description="Side-channel messages read per connection and loop round (others wait).")
    ] = 16
    max_pending_total: Annotated[
        int, Meta(description="Prefill: pending registrations from all decode ranks together, at most.")
    ] = 65536
    max_identities: Annotated[
        int, Meta(description="Prefill: decode (engine, rank) identities bound at once, at most.")
    ] = 1024
    max_peer_tp: Annotated[
        int,
        Meta(description="Largest TP size a peer's Hello may declare (its per-request work grows with it)."),
    ] = 256
    max_prefill_peers: Annotated[
        int,
        Meta(
            description="Decode: prefill ranks (engine id, address, rank) with a side-channel connection, "
            "at most (each holds three ZeroMQ sockets); unused ones that never answered are pruned first."
        ),
    ] = 256

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_message_bytes",
            "max_pending_per_peer",
            "max_pending_bytes_per_peer",
            "max_messages_per_peer_round",
            "max_pending_total",
            "max_identities",
            "max_peer_tp",
            "max_prefill_peers",
        )


class Metrics(_Group, frozen=True):
    """The optional Prometheus HTTP endpoint (prometheus_client.start_http_server)."""

    port: Annotated[
        int | None,
        Meta(
            description="Base port of the metrics endpoint: rank r serves on port + r (like the side "
            "channel), so the TP ranks of one engine never collide; null: off."
        ),
    ] = None
    host: Annotated[str, Meta(description="Address the metrics endpoint binds.")] = "127.0.0.1"
