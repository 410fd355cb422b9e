"""The shared key as a secret: from a file or $KVPUSH_HMAC_KEY (read by from_mapping, never by a
constructor), refused by name when ambiguous or unsafe, never shown by repr/str; and the advertised
address, never a wildcard."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from kvpush.config import KEY_ENV, KVPushConfig, Security, SideChannel
from kvpush.errors import ConfigError
from kvpush.platforms.vllm.params import ConnectorSettings

KEY = os.urandom(32)
B64 = base64.b64encode(KEY).decode()


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


def key_file(tmp_path: Path, text: str = B64 + "\n", mode: int = 0o600, name: str = "kvpush.key") -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_key_from_a_file_is_loaded_and_replace_keeps_it(tmp_path: Path) -> None:
    cfg = KVPushConfig.from_mapping(
        {"engine_id": "p0", "host": "10.0.0.5", "hmac_key_file": key_file(tmp_path)}
    )
    assert cfg.security.hmac_key == KEY
    cfg.check_listen()
    copy = cfg.replace(allowed_decode_ids=("d0",))
    assert copy.security.hmac_key == KEY and copy.security.allowed_decode_ids == ("d0",)


def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, B64)
    assert KVPushConfig.from_mapping({"host": "10.0.0.5"}).replace(port=1).security.hmac_key == KEY
    # the vLLM connector's settings parsing reads it through from_mapping
    s = ConnectorSettings.from_extra(
        "prefill", "p0", {"host": "10.0.0.5"}, block_size=16, tp_size=1, pp_size=1
    )
    assert s.config.security.hmac_key == KEY
    s.config.check_listen()


def test_constructors_never_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only from_mapping reads $KVPUSH_HMAC_KEY, and only from the mapping it is handed: a config built
    in code (or a copy of one) holds exactly what it was given."""
    monkeypatch.setenv(KEY_ENV, B64)
    assert KVPushConfig().security.hmac_key is None and Security().hmac_key is None
    assert KVPushConfig(host="10.0.0.5").replace(port=1).security.hmac_key is None
    assert KVPushConfig.from_mapping({}, environ={}).security.hmac_key is None
    assert KVPushConfig.from_mapping({}, environ={KEY_ENV: B64}).security.hmac_key == KEY
    monkeypatch.delenv(KEY_ENV)
    assert KVPushConfig.from_mapping({}, environ={KEY_ENV: B64}).security.hmac_key == KEY
    with pytest.raises(ConfigError, match="require_auth=True but no hmac_key"):
        monkeypatch.setenv(KEY_ENV, B64)
        Security(require_auth=True)


def test_the_vllm_extra_config_takes_a_file_path_instead_of_the_key(tmp_path: Path) -> None:
    extra = {"host": "10.0.0.5", "port": 5600, "hmac_key_file": key_file(tmp_path)}
    s = ConnectorSettings.from_extra("prefill", "p0", extra, block_size=16, tp_size=1, pp_size=1)
    assert s.config.security.hmac_key == KEY
    assert B64 not in repr(s) and repr(KEY) not in repr(s)


@pytest.mark.parametrize(
    "setup, message",
    [
        ("both", r"hmac_key and hmac_key_file '.*' both give a key; give it once"),
        ("file_and_env", rf"hmac_key_file and \${KEY_ENV} both give a key"),
        ("key_and_env", rf"hmac_key and \${KEY_ENV} both give a key"),
        ("missing", r"hmac_key_file '.*nope' cannot be read: No such file"),
        ("world", r"hmac_key_file '.*' is readable or writable by every user \(mode 644\): `chmod 600"),
        ("short", r"the key in hmac_key_file '.*' is 8 bytes; a shared key needs at least 16"),
        ("garbage", r"hmac_key_file '.*' does not hold a base64 key"),
        ("env_short", rf"the key in \${KEY_ENV} is 3 bytes"),
    ],
)
def test_ambiguous_unreadable_unsafe_or_short_keys_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: str, message: str
) -> None:
    good = key_file(tmp_path)
    cases: dict[str, dict[str, object]] = {
        "both": {"hmac_key": base64.b64encode(os.urandom(32)).decode(), "hmac_key_file": good},
        "file_and_env": {"hmac_key_file": good},
        "key_and_env": {"hmac_key": base64.b64encode(os.urandom(32)).decode()},
        "missing": {"hmac_key_file": str(tmp_path / "nope")},
        "world": {"hmac_key_file": key_file(tmp_path, mode=0o644, name="world")},
        "short": {"hmac_key_file": key_file(tmp_path, base64.b64encode(b"8 bytes!").decode(), name="short")},
        "garbage": {"hmac_key_file": key_file(tmp_path, "not base64 at all!", name="garbage")},
        "env_short": {},
    }
    if setup in ("file_and_env", "key_and_env"):
        monkeypatch.setenv(KEY_ENV, B64)
    if setup == "env_short":
        monkeypatch.setenv(KEY_ENV, base64.b64encode(b"abc").decode())
    with pytest.raises(ConfigError, match=message) as err:
        KVPushConfig.from_mapping(cases[setup])
    assert B64 not in str(err.value)


def test_repr_and_str_never_show_the_key(tmp_path: Path) -> None:
    for cfg in (
        KVPushConfig(hmac_key=KEY),
        KVPushConfig.from_mapping({"hmac_key_file": key_file(tmp_path)}),
    ):
        for text in (repr(cfg), str(cfg), repr(cfg.security), f"{cfg}"):
            assert "<redacted>" in text
            assert B64 not in text and repr(KEY) not in text and KEY.hex() not in text
    assert "hmac_key=None" in repr(Security())


def test_a_wildcard_bind_is_never_advertised() -> None:
    cfg = KVPushConfig.from_mapping({"engine_id": "p0", "host": "0.0.0.0", "hmac_key": KEY})
    with pytest.raises(ConfigError, match=r"host '0.0.0.0' binds every interface .* set advertise_host"):
        cfg.check_listen()
    ok = cfg.replace(advertise_host="192.0.2.1")
    ok.check_listen()
    assert ok.side_channel.advertised == "192.0.2.1" and SideChannel(host="10.0.0.5").advertised == "10.0.0.5"
    for wild in ("0.0.0.0", "::", ""):
        with pytest.raises(ConfigError, match="advertise_host .* is a wildcard"):
            KVPushConfig.from_mapping({"advertise_host": wild})


def test_ucx_is_left_alone_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpush.transport.nixl import prepare_environment

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    prepare_environment(KVPushConfig().nixl.ucx_net_devices)
    assert "UCX_NET_DEVICES" not in os.environ
    prepare_environment(KVPushConfig(ucx_net_devices="lo").nixl.ucx_net_devices)
    assert os.environ["UCX_NET_DEVICES"] == "lo"
