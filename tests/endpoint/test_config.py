"""KVPushConfig: grouped attributes, the flat keys deployments already write, refusals that name the key."""

from __future__ import annotations

import base64
import json
import runpy
from pathlib import Path

import pytest

from kvpush.config import FLAT_KEYS, KVPushConfig, Leases, Posting, Security, SideChannel
from kvpush.errors import ConfigError
from kvpush.platforms.vllm.params import ConnectorSettings

ROOT = Path(__file__).parents[2]
KEY = bytes(range(32))

# Every flat key KVPushConfig took before the groups (kv_connector_extra_config), where it lives now, and a
# value other than its default, as JSON would carry it.
FLAT = {
    "host": ("side_channel.host", "10.1.2.3"),
    "port": ("side_channel.port", 6000),
    "backends": ("nixl.backends", ["UCX", "LIBFABRIC"]),
    "ucx_net_devices": ("nixl.ucx_net_devices", "lo"),
    "backend_params": ("nixl.backend_params", {"LIBFABRIC": {"num_threads": 4}}),
    "lease_s": ("leases.lease_s", 30.0),
    "ready_timeout_s": ("leases.ready_timeout_s", 40.0),
    "tombstone_s": ("leases.tombstone_s", 50.0),
    "write_timeout_s": ("leases.write_timeout_s", 2.0),
    "write_linger_s": ("leases.write_linger_s", 0.5),
    "ping_interval_s": ("liveness.ping_interval_s", 0.5),
    "peer_timeout_s": ("liveness.peer_timeout_s", 2.0),
    "handshake_timeout_s": ("liveness.handshake_timeout_s", 3.0),
    "busy_poll_s": ("pacing.busy_poll_s", 1e-4),
    "max_busy_poll_s": ("pacing.max_busy_poll_s", 2e-3),
    "idle_poll_s": ("pacing.idle_poll_s", 0.05),
    "post_workers": ("posting.workers", 2),
    "max_inflight_bytes": ("posting.max_inflight_bytes", 1 << 20),
    "max_inflight_descriptors": ("posting.max_inflight_descriptors", 1000),
    "posted_nudge": ("posting.nudge", False),
    "hmac_key": ("security.hmac_key", base64.b64encode(KEY).decode()),
    "require_auth": ("security.require_auth", True),
    "allowed_decode_ids": ("security.allowed_decode_ids", ["d0"]),
    "max_message_bytes": ("limits.max_message_bytes", 1 << 16),
    "max_pending_per_peer": ("limits.max_pending_per_peer", 10),
    "max_pending_bytes_per_peer": ("limits.max_pending_bytes_per_peer", 1 << 10),
    "max_messages_per_peer_round": ("limits.max_messages_per_peer_round", 4),
    "max_pending_total": ("limits.max_pending_total", 100),  # issue 16: global caps, bounded peer TP
    "max_identities": ("limits.max_identities", 8),
    "max_peer_tp": ("limits.max_peer_tp", 64),
    "metrics_port": ("metrics.port", 9100),
    "metrics_host": ("metrics.host", "0.0.0.0"),
}
IN_CODE = {"backends": ("UCX", "LIBFABRIC"), "hmac_key": KEY, "allowed_decode_ids": ("d0",)}


def read(config: KVPushConfig, path: str) -> object:
    group, name = path.split(".")
    return getattr(getattr(config, group), name)


def test_every_flat_key_of_before_is_still_accepted_and_lands_in_its_group():
    # + engine_id, top level; keys added with their own tests: tests/endpoint/test_key_secret.py,
    # the streaming keys below (test_streaming_keys_are_checked)
    # spin_s (tests/endpoint/test_spin.py) and engine_post_max_bytes (tests/endpoint/test_engine_post.py)
    added = {"hmac_key_file", "advertise_host", "stream_min_tokens", "stream_min_bytes", "spin_s"}
    added.add("engine_post_max_bytes")
    added.add("max_prefill_peers")  # tests/endpoint/test_prefill_table.py
    assert len(FLAT) + 1 == 33 and set(FLAT) | added == set(FLAT_KEYS)
    data = json.loads(json.dumps({"engine_id": "e1", **{k: v for k, (_, v) in FLAT.items()}}))
    config = KVPushConfig.from_mapping(data)
    assert config.engine_id == "e1"
    for key, (path, value) in FLAT.items():
        assert read(config, path) == IN_CODE.get(key, value), key
        assert read(config, path) != read(KVPushConfig(), path), f"{key}: the test value is the default"
    nested: dict[str, dict[str, object]] = {}
    for path, value in FLAT.values():
        group, name = path.split(".")
        nested.setdefault(group, {})[name] = value
    assert KVPushConfig.from_mapping({"engine_id": "e1", **nested}) == config
    in_code = {k: IN_CODE.get(k, v) for k, (_, v) in FLAT.items()}
    assert KVPushConfig(engine_id="x").replace(engine_id="e1", **in_code) == config


def test_the_constructor_still_takes_every_flat_keyword_as_the_readme_of_before_wrote_it():
    in_code = {k: IN_CODE.get(k, v) for k, (_, v) in FLAT.items()}
    assert KVPushConfig(engine_id="e1", **in_code) == KVPushConfig.from_mapping(
        {"engine_id": "e1", **{k: v for k, (_, v) in FLAT.items()}}
    )
    readme = KVPushConfig(engine_id="p0", host="10.0.0.5", port=5600)  # README at 3affa6f, verbatim
    assert readme.side_channel == SideChannel(host="10.0.0.5", port=5600)
    mixed = KVPushConfig(engine_id="p0", side_channel=SideChannel(port=1), lease_s=9.0, ready_timeout_s=10.0)
    assert (mixed.side_channel.port, mixed.leases.lease_s) == (1, 9.0)
    with pytest.raises(ConfigError, match="did you mean `port`"):
        KVPushConfig(prot=5600)
    with pytest.raises(ConfigError, match="both set side_channel.port"):
        KVPushConfig(port=1, side_channel=SideChannel(port=2))
    with pytest.raises(ConfigError, match="must exceed lease_s"):
        KVPushConfig(lease_s=200.0)


def test_the_documented_extra_configs_still_load():
    """The kv_connector_extra_config samples of README.md and docs/vllm.md (placeholders filled in)."""
    readme = ConnectorSettings.from_extra("prefill", "p0", {"host": "127.0.0.1", "port": 5600}, 16, 1, 1)
    assert readme.config.side_channel == SideChannel(host="127.0.0.1", port=5600)
    assert readme.config.engine_id == "p0" and readme.config.nixl.backends == ("UCX",)
    decode = ConnectorSettings.from_extra(
        "decode",
        "d0",
        json.loads(
            '{"host":"127.0.0.1","port":5700,"pairing_port":5800,'
            '"prefill_addresses":[{"engine_id":"p0","host":"127.0.0.1","port":5600}]}'
        ),
        16,
        1,
        1,
    )
    assert decode.config.side_channel.port == 5700 and decode.pairing_port == 5800
    key = base64.b64encode(KEY).decode()
    neuron = json.loads(
        '{"host":"10.0.0.7","port":5600,"backends":["LIBFABRIC"],"ucx_net_devices":null,'
        f'"hmac_key":"{key}","allowed_decode_ids":["d0"]}}'
    )
    prefill = ConnectorSettings.from_extra("prefill", "p0", neuron, 16, 1, 1).config
    assert prefill.nixl.backends == ("LIBFABRIC",) and prefill.nixl.ucx_net_devices is None
    assert prefill.security == Security(hmac_key=KEY, allowed_decode_ids=("d0",))
    prefill.check_listen()  # beyond loopback, with a key


def test_nested_form_and_typed_groups_equal_the_flat_form():
    flat = KVPushConfig.from_mapping({"engine_id": "p", "port": 0, "lease_s": 2, "ready_timeout_s": 3})
    nested = KVPushConfig.from_mapping(
        {"engine_id": "p", "side_channel": {"port": 0}, "leases": {"lease_s": 2, "ready_timeout_s": 3}}
    )
    typed = KVPushConfig(
        engine_id="p", side_channel=SideChannel(port=0), leases=Leases(lease_s=2.0, ready_timeout_s=3.0)
    )
    assert flat == nested == typed
    assert (
        KVPushConfig.from_mapping({"leases": Leases(lease_s=2.0, ready_timeout_s=3.0)}).leases == typed.leases
    )
    assert typed.leases.write_bound_s == 11.0


def test_unknown_keys_are_refused_by_name_with_the_close_match():
    with pytest.raises(ConfigError, match=r"unknown field `prot` \(did you mean `port`\?\)"):
        KVPushConfig.from_mapping({"prot": 1})
    with pytest.raises(
        ConfigError, match=r"unknown field `posting.wokers` \(did you mean `posting.workers`\?\)"
    ):
        KVPushConfig.from_mapping({"posting": {"wokers": 2}})
    with pytest.raises(ConfigError, match="unknown field `zzz`$"):
        KVPushConfig.from_mapping({"zzz": 1})
    with pytest.raises(ConfigError, match="unknown field `lease`"):
        KVPushConfig().replace(lease=3.0)
    with pytest.raises(ConfigError, match="`leases` must be an object"):
        KVPushConfig.from_mapping({"leases": 5})


def test_a_key_given_flat_and_nested_is_refused():
    with pytest.raises(ConfigError, match="`side_channel.port` and `port` both set side_channel.port"):
        KVPushConfig.from_mapping({"port": 1, "side_channel": {"port": 2}})
    with pytest.raises(ConfigError, match="both set posting.workers"):
        KVPushConfig.from_mapping({"posting": {"workers": 1}, "post_workers": 1})
    with pytest.raises(ConfigError, match="both set leases.lease_s"):
        KVPushConfig().replace(leases=Leases(), lease_s=3.0)


def test_a_wrong_type_names_the_key_as_written():
    with pytest.raises(ConfigError, match=r"`post_workers`: Expected `int`, got `str`"):
        KVPushConfig.from_mapping({"post_workers": "two"})
    with pytest.raises(ConfigError, match=r"`posting.workers`: Expected `int`, got `str`"):
        KVPushConfig.from_mapping({"posting": {"workers": "two"}})
    with pytest.raises(ConfigError, match=r"`engine_id`: Expected `str`"):
        KVPushConfig.from_mapping({"engine_id": 3})
    with pytest.raises(ConfigError, match=r"`hmac_key`: .*base64"):
        KVPushConfig.from_mapping({"hmac_key": "not base64!"})


POSITIVE = [
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
    "max_pending_per_peer",
    "max_pending_bytes_per_peer",
    "max_messages_per_peer_round",
    "max_inflight_bytes",
    "max_inflight_descriptors",
]
REFUSED = [
    ({"engine_id": ""}, "engine_id must be a non-empty string"),
    ({"port": 70000}, "port 70000 is out of range"),
    ({"port": -1}, "port -1 is out of range"),
    ({"lease_s": 10.0, "ready_timeout_s": 5.0}, r"ready_timeout_s \(5.0\) must exceed lease_s \(10.0\)"),
    ({"busy_poll_s": 0.01, "max_busy_poll_s": 0.001}, r"max_busy_poll_s \(0.001\) must be >= busy_poll_s"),
    ({"backends": []}, "backends must name at least one NIXL backend"),
    ({"ping_interval_s": 5.0, "peer_timeout_s": 5.0}, r"peer_timeout_s \(5.0\) must exceed ping_interval_s"),
    ({"hmac_key": b""}, "hmac_key is 0 bytes; a shared key needs at least 16"),
    ({"hmac_key": b"short"}, "hmac_key is 5 bytes; a shared key needs at least 16"),
    ({"require_auth": True}, "require_auth=True but no hmac_key is set"),
    ({"backend_params": {"LIBFABRIC": {"num_threads": 4}}}, r"backend_params names backends \['LIBFABRIC'\]"),
    ({"post_workers": -1}, r"post_workers \(posting.workers\) must be in 0..64, got -1"),
    ({"post_workers": 65}, r"must be in 0..64, got 65"),
    *[({name: 0}, f"{name} must be > 0, got 0") for name in POSITIVE],
]


@pytest.mark.parametrize("changes, message", REFUSED, ids=[str(c) for c, _ in REFUSED])
def test_every_check_still_refuses_through_from_mapping_and_replace(changes, message):
    with pytest.raises(ConfigError, match=message):
        KVPushConfig.from_mapping(changes)
    with pytest.raises(ConfigError, match=message):
        KVPushConfig().replace(**changes)


def test_groups_check_themselves_when_built_in_code():
    with pytest.raises(ConfigError, match="must exceed lease_s"):
        Leases(lease_s=10.0, ready_timeout_s=5.0)
    with pytest.raises(ConfigError, match="0..64"):
        Posting(workers=100)
    with pytest.raises(ConfigError, match="out of range"):
        SideChannel(port=70000)


def test_listening_beyond_loopback_needs_a_key_unless_switched_off():
    with pytest.raises(ConfigError, match="beyond loopback"):
        KVPushConfig.from_mapping({"host": "10.0.0.5"}).check_listen()
    KVPushConfig.from_mapping({"engine_id": "p0", "host": "10.0.0.5", "require_auth": False}).check_listen()
    KVPushConfig.from_mapping({"engine_id": "p0", "host": "10.0.0.5", "hmac_key": KEY}).check_listen()
    assert not KVPushConfig().auth_required and KVPushConfig().replace(host="::1").auth_required is False


def test_replace_returns_a_checked_copy_and_leaves_the_original():
    base = KVPushConfig(engine_id="p")
    changed = base.replace(post_workers=2, leases={"lease_s": 5.0, "ready_timeout_s": 6.0})
    assert (
        changed.posting.workers == 2 and changed.leases.lease_s == 5.0 and changed.leases.tombstone_s == 300.0
    )
    assert base.posting.workers == 0 and base.leases == Leases()
    assert base.replace(posting=Posting(workers=3)).posting == Posting(workers=3)


def test_docs_config_md_lists_every_key_as_the_structs_define_it():
    doc = (ROOT / "docs" / "config.md").read_text()
    reference = runpy.run_path(str(ROOT / "scripts" / "config_doc.py"))["reference"]()
    assert f"<!-- config keys -->\n{reference}\n<!-- end config keys -->" in doc, (
        "docs/config.md is out of date: regenerate with scripts/config_doc.py"
    )
    for key in FLAT:
        assert f"| `{key}` |" in doc


def test_streaming_keys_are_checked():
    config = KVPushConfig.from_mapping({"stream_min_tokens": 512, "streaming": {"min_bytes": 4096}})
    assert (config.streaming.min_tokens, config.streaming.min_bytes) == (512, 4096)
    with pytest.raises(ConfigError, match="stream_min_tokens"):
        KVPushConfig.from_mapping({"stream_min_tokens": -1})
    assert KVPushConfig().streaming.min_tokens > 0  # short requests move in one piece by default
