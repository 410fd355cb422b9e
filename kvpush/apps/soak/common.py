"""What the soak's driver and its child processes agree on: identities, the shared key, the fault kinds,
and the small geometry and short timeouts that let a 2-core box cycle through many faults."""

from __future__ import annotations

from kvpush.apps.demo.procs import Geometry
from kvpush.config import KVPushConfig, Leases, Liveness, Security, SideChannel, Streaming
from kvpush.transport.faults import FAULT_KINDS as TRANSPORT_FAULTS

PREFILL_ID, DECODE_ID = "soak-prefill", "soak-decode"
MARK = "soak-attacker"  # the attacker's abort reason: an honest request ending with it was hijacked
# A key holder bound under its own identity (another decode, or a compromised one) acting on the soak
# decode's requests: its abort reason, and its engine id (issue 16 finding 2)
CROSS_MARK = "soak-cross-peer"
HOLDER_ID = "soak-other-decode"
KEY = b"kvpush-soak-shared-secret-32byte"
DRIVER_FAULTS = (
    "kill_prefill",
    "kill_decode",
    "stop_prefill",
    "stop_decode",
    "abort_decode",
    "abort_prefill",
    "resend",
    "forged",
    "replayed",
    "hijack",
    "cross_peer",  # a key holder's registration and abort for the decode's live requests
    "huge_tp",  # a key holder's Hello declaring decode TP 65,536 with 2 KV heads
    "reset_side_channel",  # a relay between decode and prefill resets (and maybe black-holes) the flow
    "long_prompt",  # an extra request of many blocks
    "abort_mid_stream",  # the prefill aborts a streamed request after some of its ranges (stream.py)
)
FAULT_KINDS = DRIVER_FAULTS + TRANSPORT_FAULTS
SELF_CHECKS = ("corrupt", "stale", "leak", "unauthorized", "early")
# the transport faults' rates with --faults all (per notification or per WRITE)
TRANSPORT_RATES = {
    "notif_drop": 0.02,
    "notif_dup": 0.03,
    "notif_reorder": 0.04,
    "slow_write_complete": 0.03,
    "slow_write_post": 0.03,
}


def chosen_faults(spec: str) -> tuple[str, ...]:
    """`--faults`: "all", "none", or kinds separated by commas (e.g. "abort_mid_stream,abort_prefill", a
    run with aborts and no kills, where a block that never comes back cannot be reclaimed by a restart)."""
    if spec == "all":
        return FAULT_KINDS
    if spec == "none":
        return ()
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown fault kind(s) {unknown or [spec]}: use all, none or some of {FAULT_KINDS}")
    return kinds


def soak_geometry(block_size: int, num_blocks: int, tp_size: int = 1) -> Geometry:
    """Small caches (2 KiB per token over all ranks) so a 2-core box moves many requests; the pattern
    checks every byte. Two KV heads: TP 1 or 2 on either side."""
    return Geometry(
        layers=4,
        total_kv_heads=2,
        head_dim=64,
        dtype_size=2,
        block_size=block_size,
        num_blocks=num_blocks,
        tp_size=tp_size,
    )


def soak_config(engine_id: str, port: int) -> KVPushConfig:
    """Short leases and timeouts so a request that a fault stranded comes back within seconds."""
    return KVPushConfig(
        engine_id=engine_id,
        side_channel=SideChannel(port=port),
        security=Security(hmac_key=KEY),
        leases=Leases(
            lease_s=2.0, ready_timeout_s=3.0, write_timeout_s=0.8, write_linger_s=0.3, tombstone_s=30.0
        ),
        liveness=Liveness(ping_interval_s=0.25, peer_timeout_s=1.5, handshake_timeout_s=3.0),
        # streamed requests of 256 tokens and more move range by range (a layer of 256 tokens: 128 KiB);
        # shorter ones are held until prefill_done (endpoint/early.py): the soak runs both paths
        streaming=Streaming(min_tokens=256, min_bytes=16 * 1024),
    )
