"""`kvpush cluster` against moto's offline EC2 and S3 (no credentials, no network)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush import cli
from kvpush.apps.cluster import PROFILES, Interface, Node, check_nodes, render_env
from tests.infra.infra_tools import python_dep

REGION = "us-east-2"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials, and nothing from the developer's own AWS set-up."""
    for name in (
        "AWS_PROFILE",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_SESSION_TOKEN",
        "KVPUSH_CLUSTER",
        "KVPUSH_REGION",
        "KVPUSH_RESULTS_BUCKET",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("KVPUSH_NODE_ENV", str(tmp_path / "no-node.env"))


@pytest.fixture
def aws(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    python_dep("boto3")
    moto = python_dep("moto")
    from moto.ec2.models import elastic_network_interfaces

    # moto records neither an interface's type nor its network card; the cluster builder below stores
    # both on the interface and this patch reports them, as EC2 does.
    original = elastic_network_interfaces.Attachment.__init__

    def attachment_init(self: Any, eni: Any) -> None:
        original(self, eni)
        self.network_card_index = getattr(eni, "network_card", 0)

    monkeypatch.setattr(elastic_network_interfaces.Attachment, "__init__", attachment_init)
    with moto.mock_aws():
        import boto3

        yield boto3.Session(region_name=REGION)


def _backend() -> Any:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    return ec2_backends[DEFAULT_ACCOUNT_ID][REGION]


def build_cluster(
    session: Any,
    name: str = "kvpush-p5en",
    instance_type: str = "p5en.48xlarge",
    efa_cards: int | None = None,
    roles: tuple[str, ...] = ("prefill", "decode", "proxy"),
    second_subnet_for: str = "",
) -> dict[str, str]:
    """Instances as the Terraform module would make them: tags, ENA primary, one EFA-only per card."""
    ec2 = session.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.0.0/20", AvailabilityZone=f"{REGION}b")["Subnet"][
        "SubnetId"
    ]
    other = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.16.0/20", AvailabilityZone=f"{REGION}b")["Subnet"][
        "SubnetId"
    ]
    cards = PROFILES[instance_type].network_cards if efa_cards is None else efa_cards
    ids = {}
    for role in roles:
        kind = "m7i.4xlarge" if role == "proxy" else instance_type
        tags = [
            {"Key": "kvpush:cluster", "Value": name},
            {"Key": "kvpush:role", "Value": role},
            {"Key": "kvpush:index", "Value": "0"},
            {"Key": "Name", "Value": f"{name}-{role}-0"},
        ]
        instance = ec2.run_instances(
            ImageId="ami-12c6146b",
            MinCount=1,
            MaxCount=1,
            InstanceType=kind,
            SubnetId=subnet,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )["Instances"][0]
        ids[role] = instance["InstanceId"]
        if role == "proxy":
            continue
        for card in range(cards):
            eni_subnet = other if (role == second_subnet_for and card == cards - 1) else subnet
            eni = ec2.create_network_interface(SubnetId=eni_subnet)["NetworkInterface"]["NetworkInterfaceId"]
            model = _backend().get_network_interface(eni)
            model.interface_type = "efa-only"
            model.network_card = card
            ec2.attach_network_interface(
                NetworkInterfaceId=eni, InstanceId=instance["InstanceId"], DeviceIndex=1 if card == 0 else 0
            )
    return ids


def kvpush(*args: str) -> int:
    return cli.main(["cluster", *args])


def test_list_shows_every_node(aws: Any, capsys: pytest.CaptureFixture[str]) -> None:
    build_cluster(aws)
    assert kvpush("list", "--name", "kvpush-p5en", "--region", REGION) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "ROLE",
        "INSTANCE",
        "TYPE",
        "STATE",
        "PRIVATE",
        "IP",
        "PUBLIC",
        "IP",
        "EFA",
    ]
    rows = [line.split() for line in lines[1:]]
    assert [(r[1], r[3], r[4], r[-1]) for r in rows] == [
        ("prefill", "p5en.48xlarge", "running", "16"),
        ("decode", "p5en.48xlarge", "running", "16"),
        ("proxy", "m7i.4xlarge", "running", "-"),
    ]
    assert all(r[5].startswith("10.42.") for r in rows)


def test_list_json(aws: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    build_cluster(aws)
    assert kvpush("list", "--name", "kvpush-p5en", "--region", REGION, "--json") == 0
    nodes = json.loads(capsys.readouterr().out)
    assert [(n["role"], n["efa_interfaces"]) for n in nodes] == [
        ("prefill", 16),
        ("decode", 16),
        ("proxy", 0),
    ]


def test_on_a_node_name_and_region_come_from_its_env_file(
    aws: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    build_cluster(aws)
    (tmp_path / "node.env").write_text(f"# node set-up\nKVPUSH_CLUSTER=kvpush-p5en\nKVPUSH_REGION={REGION}\n")
    monkeypatch.setenv("KVPUSH_NODE_ENV", str(tmp_path / "node.env"))
    assert kvpush("list") == 0
    assert "kvpush-p5en-prefill-0" in capsys.readouterr().out


def test_check_passes_a_correct_cluster(aws: Any, capsys: pytest.CaptureFixture[str]) -> None:
    build_cluster(aws)
    assert kvpush("check", "--name", "kvpush-p5en", "--region", REGION) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out and "one EFA interface per network card" in out


def test_check_counts_efa_against_describe_instance_types(
    aws: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    build_cluster(aws, name="trn", instance_type="trn1.32xlarge", efa_cards=7)
    assert kvpush("check", "--name", "trn", "--region", REGION) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 2
    assert (
        "7 EFA interfaces on 7 network cards, expected one on each of the 8 cards of trn1.32xlarge"
        in problems[0]
    )


def test_check_finds_a_missing_role_and_a_second_subnet(aws: Any, capsys: pytest.CaptureFixture[str]) -> None:
    build_cluster(aws, roles=("prefill", "proxy"), second_subnet_for="prefill")
    assert kvpush("check", "--name", "kvpush-p5en", "--region", REGION) == 1
    out = capsys.readouterr().out
    assert "PROBLEM no decode node" in out
    assert "interfaces in 2 subnets" in out


def test_check_reports_stopped_nodes(aws: Any, capsys: pytest.CaptureFixture[str]) -> None:
    ids = build_cluster(aws)
    aws.client("ec2").stop_instances(InstanceIds=[ids["decode"]])
    assert kvpush("check", "--name", "kvpush-p5en", "--region", REGION) == 1
    assert "kvpush-p5en-decode-0: state is stopped, not running" in capsys.readouterr().out


def test_env_writes_what_the_scripts_read(aws: Any, tmp_path: Path) -> None:
    build_cluster(aws)
    target = tmp_path / "cluster.env"
    assert kvpush("env", "--name", "kvpush-p5en", "--region", REGION, "-o", str(target), "--model", "m") == 0
    env = dict(line.split("=", 1) for line in target.read_text().splitlines() if not line.startswith("#"))
    nodes = {
        n["Tags"][1]["Value"]: n
        for r in aws.client("ec2").describe_instances()["Reservations"]
        for n in r["Instances"]
    }
    assert env["PREFILL_HOST"] == nodes["prefill"]["PrivateIpAddress"]
    assert env["DECODE_HOST"] == nodes["decode"]["PrivateIpAddress"]
    assert env["PROXY_HOST"] == nodes["proxy"]["PrivateIpAddress"]
    assert {
        k: env[k]
        for k in (
            "KVPUSH_CLUSTER",
            "KVPUSH_REGION",
            "PREFILL_PORT",
            "DECODE_PORT",
            "PROXY_PORT",
            "SIDE_CHANNEL_PORT",
            "PREFILL_TP_SIZE",
            "PREFILL_PP_SIZE",
            "KV_BUFFER_DEVICE",
            "MODEL",
        )
    } == {
        "KVPUSH_CLUSTER": "kvpush-p5en",
        "KVPUSH_REGION": REGION,
        "PREFILL_PORT": "8100",
        "DECODE_PORT": "8200",
        "PROXY_PORT": "8000",
        "SIDE_CHANNEL_PORT": "5600",
        "PREFILL_TP_SIZE": "8",
        "PREFILL_PP_SIZE": "1",
        "KV_BUFFER_DEVICE": "cuda",
        "MODEL": "m",
    }


def test_env_to_stdout_uses_the_instance_types_tp(aws: Any, capsys: pytest.CaptureFixture[str]) -> None:
    build_cluster(aws, name="t2", instance_type="trn2.48xlarge")
    assert kvpush("env", "--name", "t2", "--region", REGION, "-o", "-", "--side-channel-port", "6000") == 0
    out = capsys.readouterr().out
    assert (
        "PREFILL_TP_SIZE=64\n" in out
        and "KV_BUFFER_DEVICE=cuda\n" in out
        and "SIDE_CHANNEL_PORT=6000\n" in out
    )


def test_upload_results_to_s3(aws: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s3 = aws.client("s3")
    s3.create_bucket(Bucket="kvpush-results", CreateBucketConfiguration={"LocationConstraint": REGION})
    results = tmp_path / "results"
    (results / "plots").mkdir(parents=True)
    (results / "push_qps1_in128_out16_iter0.json").write_text("{}")
    (results / "plots" / "ttft.png").write_bytes(b"png")
    assert (
        kvpush(
            "upload",
            str(results),
            "--name",
            "c1",
            "--region",
            REGION,
            "--bucket",
            "kvpush-results",
            "--prefix",
            "kvpush/c1/run1",
        )
        == 0
    )
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="kvpush-results")["Contents"])
    assert keys == ["kvpush/c1/run1/plots/ttft.png", "kvpush/c1/run1/push_qps1_in128_out16_iter0.json"]
    assert "uploaded 2 files to s3://kvpush-results/kvpush/c1/run1/" in capsys.readouterr().out


def test_upload_to_a_missing_bucket_is_one_clear_line(
    aws: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.json").write_text("{}")
    assert kvpush("upload", str(tmp_path), "--name", "c1", "--region", REGION, "--bucket", "nope") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpush cluster: S3 upload failed") and "\n" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("list", "--name", "kvpush-p5en", "--region", REGION),
            "no nodes tagged kvpush:cluster=kvpush-p5en in us-east-2",
        ),
        (("list", "--name", "kvpush-p5en", "--region", "us-east-2b"), "unknown AWS region 'us-east-2b'"),
        (("list", "--name", "kvpush-p5en"), "no AWS region"),
        (("check", "--region", REGION), "no cluster name"),
        (
            ("upload", "/nonexistent-results", "--name", "c", "--region", REGION, "--bucket", "b"),
            "is not a folder",
        ),
    ],
)
def test_clear_errors(
    aws: Any, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    assert kvpush(*args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_credentials(
    aws_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    python_dep("boto3")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert kvpush("list", "--name", "c", "--region", REGION) == 2
    assert "no AWS credentials found" in capsys.readouterr().err


def test_unknown_profile(aws_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    python_dep("boto3")
    assert kvpush("list", "--name", "c", "--region", REGION, "--profile", "nobody") == 2
    assert "AWS profile 'nobody' not found" in capsys.readouterr().err


def _node(role: str, **overrides: Any) -> Node:
    interfaces = tuple(
        Interface(f"eni-{card}", "efa-only", card, 1 if card == 0 else 0, "subnet-a") for card in range(16)
    )
    fields: dict[str, Any] = dict(
        name=f"{role}-0",
        role=role,
        index=0,
        instance_id=f"i-{role}",
        instance_type="p5en.48xlarge",
        state="running",
        private_ip="10.0.0.1",
        public_ip="",
        availability_zone="us-east-2b",
        subnet_id="subnet-a",
        placement_group="pg",
        interfaces=(Interface("eni-p", "interface", 0, 0, "subnet-a"), *interfaces),
    )
    fields.update(overrides)
    return Node(**fields)


def test_check_nodes_flags_an_efa_only_primary_and_split_zones() -> None:
    from kvpush.apps.cluster import TypeFacts

    facts = {"p5en.48xlarge": TypeFacts("p5en.48xlarge", 16, True, 16)}
    bad_primary = _node(
        "prefill",
        interfaces=(Interface("eni-p", "efa-only", 0, 0, "subnet-a"), *_node("prefill").interfaces[1:]),
    )
    problems = check_nodes(
        [bad_primary, _node("decode", availability_zone="us-east-2c", subnet_id="subnet-b")], facts
    )
    assert any("primary interface is efa-only" in p for p in problems)
    assert any("2 subnets" in p for p in problems) and any("2 Availability Zones" in p for p in problems)
    assert check_nodes([_node("prefill"), _node("decode")], facts) == []


def test_render_env_needs_prefill_and_decode() -> None:
    from kvpush.apps.cluster import DEFAULT_PORTS, ClusterError

    with pytest.raises(ClusterError, match="no decode node"):
        render_env("c", REGION, [_node("prefill")], DEFAULT_PORTS)


def test_without_boto3_the_error_says_what_to_install(
    aws_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` raise ModuleNotFoundError
    assert kvpush("list", "--name", "c", "--region", REGION) == 2
    from kvpush.apps.install_hint import install_command

    assert install_command("cluster") in capsys.readouterr().err
