"""`kvpush cluster key` against moto's offline Secrets Manager: the node set-up's copy of the shared key
from the secret Terraform generates into the 0600 file scripts/serve_pd.sh points the engines at."""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush import cli
from kvpush.config import KVPushConfig
from tests.infra.infra_tools import ROOT, python_dep
from tests.infra.test_cluster_cli import REGION, aws_env  # noqa: F401 (a fixture)

KEY = bytes(range(100, 132))


@pytest.fixture
def secrets(aws_env: None) -> Iterator[Any]:  # noqa: F811
    python_dep("boto3")
    moto = python_dep("moto")
    with moto.mock_aws():
        import boto3

        yield boto3.Session(region_name=REGION).client("secretsmanager")


def _cluster(*args: str) -> int:
    return cli.main(["cluster", "key", "--region", REGION, *args])


def test_the_key_is_copied_into_a_0600_file_the_connector_reads(
    secrets: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arn = secrets.create_secret(Name="c1/hmac-key", SecretString=base64.b64encode(KEY).decode())["ARN"]
    out = tmp_path / "etc" / "hmac.key"
    out.parent.mkdir()
    out.write_text("an old key\n")
    out.chmod(0o644)  # a looser file already there is replaced, not reused
    assert _cluster("--secret-id", arn, "--output", str(out)) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert [p.name for p in out.parent.iterdir()] == ["hmac.key"]  # no temporary file left behind
    printed = capsys.readouterr()
    assert str(out) in printed.out and base64.b64encode(KEY).decode() not in printed.out + printed.err
    cfg = KVPushConfig.from_mapping(
        {"engine_id": "p0", "host": "10.0.0.5", "hmac_key_file": str(out)}, environ={}
    )
    assert cfg.security.hmac_key == KEY
    cfg.check_listen()


def test_the_secret_id_comes_from_node_env_and_a_terraform_style_password_is_a_key(
    secrets: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What terraform/ stores: aws_secretsmanager_random_password with 44 letters and digits, which is
    base64 of 33 bytes; node.env names the secret (the node set-up writes it)."""
    password = secrets.get_random_password(PasswordLength=44, ExcludePunctuation=True)["RandomPassword"]
    arn = secrets.create_secret(Name="c1/hmac-key", SecretString=password)["ARN"]
    node_env = tmp_path / "node.env"
    node_env.write_text(f"KVPUSH_CLUSTER=c1\nKVPUSH_HMAC_KEY_SECRET={arn}\n")
    monkeypatch.setenv("KVPUSH_NODE_ENV", str(node_env))
    out = tmp_path / "hmac.key"
    assert _cluster("--output", str(out)) == 0
    assert KVPushConfig.from_mapping({"hmac_key_file": str(out)}, environ={}).security.hmac_key == (
        base64.b64decode(password)
    )
    assert len(base64.b64decode(password)) == 33


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not base64 at all!", "does not hold a base64 key"),
        (base64.b64encode(b"short").decode(), "is 5 bytes; a shared key needs at least 16"),
    ],
)
def test_a_bad_secret_writes_nothing_and_never_shows_the_value(
    secrets: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    arn = secrets.create_secret(Name="c1/hmac-key", SecretString=value)["ARN"]
    out = tmp_path / "hmac.key"
    assert _cluster("--secret-id", arn, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert message in err and value not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_missing_or_unnamed_secret_is_refused_by_name(
    secrets: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cluster("--output", str(tmp_path / "k")) == 2
    assert "no secret: pass --secret-id" in capsys.readouterr().err
    assert _cluster("--secret-id", "c1/nope", "--output", str(tmp_path / "k")) == 2
    assert "ResourceNotFoundException" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()


def test_serve_pd_reads_the_file_the_cluster_key_command_writes() -> None:
    from kvpush.apps.cluster_key import DEFAULT_KEY_FILE

    script = (ROOT / "scripts" / "serve_pd.sh").read_text()
    assert f"HMAC_KEY_FILE=${{HMAC_KEY_FILE:-{DEFAULT_KEY_FILE}}}" in script
    assert os.path.dirname(DEFAULT_KEY_FILE) == "/etc/kvpush"  # beside node.env, which the set-up writes
