"""Every bad configuration value an operator can write is refused when the config is built (not at
start()), by a ConfigError naming the key as written: KVPushConfig's keys through the constructor and
from_mapping, the vLLM connector's own keys through the same msgspec-checked path."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvpush.config import KVPushConfig
from kvpush.errors import ConfigError
from kvpush.platforms.vllm.params import ConnectorSettings

KEY_TEXT = base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
ADDR = {"engine_id": "p0", "host": "127.0.0.1", "port": 5600, "tp_size": 1}

# (flat keys, what the error must name)
CORE_BAD: list[tuple[dict[str, Any], str]] = [
    ({"metrics_port": -9}, r"`metrics_port` -9 is not a TCP port"),
    ({"metrics_port": 700000}, r"`metrics_port` 700000 is not a TCP port"),
    ({"backends": ["EFA"]}, r"`backends` names \['EFA'\].*\['UCX', 'LIBFABRIC'\]"),
    ({"backends": ["ucx"]}, r"`backends` names \['ucx'\]"),
    ({"port": 70000}, r"port 70000 is out of range"),
    ({"hmac_key": "not base64!"}, r"`hmac_key`: Invalid base64.*read as base64 everywhere"),
    ({"engine_id": ""}, r"engine_id must be a non-empty string"),
]

CONNECTOR_BAD: list[tuple[dict[str, Any], str]] = [
    ({"pairing_port": "abc"}, r"`pairing_port`: Expected `int`, got `str`"),
    ({"pairing_port": 70000}, r"`pairing_port`: Expected `int` <= 65535"),
    ({"prefill_addresses": [{**ADDR, "port": -7}]}, r"`prefill_addresses\[0\]\.port`: Expected `int` >= 0"),
    (
        {"prefill_addresses": [{**ADDR, "tp_size": 0}]},
        r"`prefill_addresses\[0\]\.tp_size`: Expected `int` >= 1",
    ),
    (
        {"prefill_addresses": [{**ADDR, "zone": "a"}]},
        r"`prefill_addresses\[0\]`: Object contains unknown field `zone`",
    ),
    ({"prefill_addresses": [{"engine_id": "p0"}]}, r"`prefill_addresses\[0\]`: port is required"),
    ({"prefill_addresses": [{**ADDR, "pp_size": 2}]}, r"`prefill_addresses\[0\]`: pp_size: pp_size=2"),
    ({"prefill_addresses": {"engine_id": "p0"}}, r"`prefill_addresses`: Expected `array`"),
    ({"idle_wait_ms": -1}, r"`idle_wait_ms`: Expected `float` >= 0"),
    ({"connect_timeout_s": 0}, r"`connect_timeout_s`: Expected `float` > 0"),
    ({"stream": "maybe"}, r"`stream`: Expected `bool`"),
    ({"metrics_port": -9}, r"`metrics_port` -9 is not a TCP port"),
    ({"backends": ["EFA"]}, r"`backends` names \['EFA'\]"),
]


@pytest.mark.parametrize(("keys", "message"), CORE_BAD, ids=[str(k) for k, _ in CORE_BAD])
def test_kvpush_config_refuses_at_build_time(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVPushConfig.from_mapping(keys, environ={})
    with pytest.raises(ConfigError, match=message):
        KVPushConfig(**keys)


@pytest.mark.parametrize("value", ["5600", 5600.0, None, [5600]])
def test_a_wrong_type_in_the_constructor_names_its_key(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"`port`: Expected `int`"):
        KVPushConfig(port=value)


@pytest.mark.parametrize(("extra", "message"), CONNECTOR_BAD, ids=[str(k) for k, _ in CONNECTOR_BAD])
def test_connector_keys_refuse_at_build_time(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorSettings.from_extra("decode", "d0", extra, block_size=16, tp_size=1, pp_size=1)


def test_a_default_engine_id_is_refused_where_it_would_collide() -> None:
    beyond = KVPushConfig.from_mapping({"host": "10.0.0.5", "hmac_key": KEY_TEXT}, environ={})
    with pytest.raises(ConfigError, match=r"needs its own `engine_id` \(it is the default 'kvpush'\)"):
        beyond.check_listen()
    beyond.replace(engine_id="p0").check_listen()
    KVPushConfig().check_listen()  # one engine on loopback: the default is fine
    pairing = {"pairing_port": 8300, "hmac_key": KEY_TEXT}
    with pytest.raises(ConfigError, match=r"engine_id is the default 'kvpush': a decode that pairs"):
        ConnectorSettings.from_extra("decode", "kvpush", pairing, block_size=16, tp_size=1, pp_size=1)
    far = {"prefill_addresses": [{**ADDR, "host": "10.0.0.5"}], "hmac_key": KEY_TEXT}
    with pytest.raises(ConfigError, match=r"engine_id is the default 'kvpush'"):
        ConnectorSettings.from_extra("decode", "kvpush", far, block_size=16, tp_size=1, pp_size=1)
    assert ConnectorSettings.from_extra("decode", "d0", pairing, 16, 1, 1).pairing_port == 8300


def test_one_key_encoding_everywhere() -> None:
    """A key given as text is base64 in the constructor, JSON, the key file and the environment alike, so
    the same text on both sides is the same key."""
    from_python = KVPushConfig(hmac_key=KEY_TEXT).security.hmac_key
    from_json = KVPushConfig.from_mapping({"hmac_key": KEY_TEXT}, environ={}).security.hmac_key
    from_env = KVPushConfig.from_mapping({}, environ={"KVPUSH_HMAC_KEY": KEY_TEXT}).security.hmac_key
    assert from_python == from_json == from_env == b"0123456789abcdef0123456789abcdef"
    assert KVPushConfig(hmac_key=b"0123456789abcdef0123456789abcdef").security.hmac_key == from_json


def test_good_connector_values_still_load() -> None:
    s = ConnectorSettings.from_extra(
        "decode",
        "d0",
        {
            "prefill_addresses": [ADDR],
            "pairing_port": 8300,
            "stream": True,
            "idle_wait_ms": 5,
            "stats_dir": None,
        },
        block_size=16,
        tp_size=1,
        pp_size=1,
    )
    assert s.prefill_addresses[0].port == 5600 and s.pairing_port == 8300 and s.stream
    assert s.idle_wait_s == 0.005 and s.stats_dir == ""
