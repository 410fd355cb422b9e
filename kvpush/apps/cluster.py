"""`kvpush cluster`: the AWS test cluster built by terraform/, seen from the EC2 API.

The Terraform module tags every node with kvpush:cluster (the cluster name), kvpush:role (prefill,
decode or proxy) and kvpush:index. This command finds the nodes by those tags, checks what EFA needs
(one EFA interface on every network card the instance type has, one subnet, running state), writes the
env file that scripts/serve_pd.sh and scripts/run_sweep.sh read, uploads a results folder to S3, and
copies the shared HMAC key from Secrets Manager to a 0600 file (cluster_key.py).

Exit codes: 0 fine, 1 a check found a problem, 2 the command could not run (no credentials, unknown
region, no nodes, bad arguments); every error is one line that says what to do.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .cluster_aws import ClusterError, aws_call, aws_pages, aws_session
from .cluster_key import DEFAULT_KEY_FILE, SECRET_ENV, copy_key
from .install_hint import install_command

TAG_CLUSTER = "kvpush:cluster"
TAG_ROLE = "kvpush:role"
TAG_INDEX = "kvpush:index"
ROLES = ("prefill", "decode", "proxy")
ACCELERATED_ROLES = ("prefill", "decode")
EFA_INTERFACE_TYPES = ("efa", "efa-only")
LIVE_STATES = ("pending", "running", "stopping", "stopped")

DEFAULT_PORTS = {"proxy": 8000, "prefill": 8100, "decode": 8200, "side_channel": 5600}


@dataclass(frozen=True)
class InstanceProfile:
    """What kvpush expects of an accelerated instance type; mirrors terraform/modules/efa-cluster/
    instance_profiles.tf (tests/infra keeps the two equal)."""

    network_cards: int
    accelerator: str
    accelerator_count: int
    default_tp_size: int
    kv_buffer_device: str


# kv_buffer_device: what vLLM's kv_transfer_config gets. vllm-neuron expects "cuda" (device HBM registered as
# VRAM); "neuron" fails vLLM's "{device_type} with {kv_buffer_device} kv_buffer is not supported" check.
PROFILES: dict[str, InstanceProfile] = {
    "p5en.48xlarge": InstanceProfile(16, "nvidia", 8, 8, "cuda"),
    "trn1.32xlarge": InstanceProfile(8, "neuron", 16, 32, "cuda"),
    "trn1n.32xlarge": InstanceProfile(16, "neuron", 16, 32, "cuda"),
    "trn2.48xlarge": InstanceProfile(16, "neuron", 16, 64, "cuda"),
}


@dataclass(frozen=True)
class Interface:
    interface_id: str
    interface_type: str
    network_card_index: int
    device_index: int
    subnet_id: str


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    index: int
    instance_id: str
    instance_type: str
    state: str
    private_ip: str
    public_ip: str
    availability_zone: str
    subnet_id: str
    placement_group: str
    interfaces: tuple[Interface, ...] = field(default=())

    @property
    def efa_interfaces(self) -> tuple[Interface, ...]:
        return tuple(i for i in self.interfaces if i.interface_type in EFA_INTERFACE_TYPES)


@dataclass(frozen=True)
class TypeFacts:
    """DescribeInstanceTypes facts about one instance type."""

    instance_type: str
    network_cards: int
    efa_supported: bool
    max_efa_interfaces: int


def find_nodes(session: Any, cluster: str, include_stopped: bool = True) -> list[Node]:
    """Every instance tagged kvpush:cluster=<cluster> and not terminated, with its interfaces."""
    region = session.region_name
    ec2 = session.client("ec2")
    states = list(LIVE_STATES) if include_stopped else ["pending", "running"]
    instances: list[dict[str, Any]] = []
    for page in aws_pages(
        region,
        ec2,
        "describe_instances",
        Filters=[
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": states},
        ],
    ):
        for reservation in page.get("Reservations", []):
            instances.extend(reservation.get("Instances", []))
    if not instances:
        return []

    interfaces: dict[str, list[Interface]] = {}
    for page in aws_pages(
        region,
        ec2,
        "describe_network_interfaces",
        Filters=[{"Name": "attachment.instance-id", "Values": [i["InstanceId"] for i in instances]}],
    ):
        for eni in page.get("NetworkInterfaces", []):
            attachment = eni.get("Attachment") or {}
            interfaces.setdefault(attachment.get("InstanceId", ""), []).append(
                Interface(
                    interface_id=eni["NetworkInterfaceId"],
                    interface_type=eni.get("InterfaceType", "interface"),
                    network_card_index=int(attachment.get("NetworkCardIndex", 0)),
                    device_index=int(attachment.get("DeviceIndex", 0)),
                    subnet_id=eni.get("SubnetId", ""),
                )
            )

    nodes = [_node(i, interfaces.get(i["InstanceId"], [])) for i in instances]
    return sorted(nodes, key=lambda n: (_role_order(n.role), n.index, n.instance_id))


def _role_order(role: str) -> int:
    return ROLES.index(role) if role in ROLES else len(ROLES)


def _node(instance: dict[str, Any], interfaces: list[Interface]) -> Node:
    tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
    role = tags.get(TAG_ROLE, "?")
    try:
        index = int(tags.get(TAG_INDEX, "0"))
    except ValueError:
        index = 0
    placement = instance.get("Placement", {})
    return Node(
        name=tags.get("Name", instance["InstanceId"]),
        role=role,
        index=index,
        instance_id=instance["InstanceId"],
        instance_type=instance.get("InstanceType", "?"),
        state=instance.get("State", {}).get("Name", "?"),
        private_ip=instance.get("PrivateIpAddress", ""),
        public_ip=instance.get("PublicIpAddress", ""),
        availability_zone=placement.get("AvailabilityZone", ""),
        subnet_id=instance.get("SubnetId", ""),
        placement_group=placement.get("GroupName", ""),
        interfaces=tuple(sorted(interfaces, key=lambda i: (i.network_card_index, i.device_index))),
    )


def describe_types(session: Any, instance_types: Sequence[str]) -> dict[str, TypeFacts]:
    if not instance_types:
        return {}
    ec2 = session.client("ec2")
    reply = aws_call(
        session.region_name, ec2.describe_instance_types, InstanceTypes=sorted(set(instance_types))
    )
    facts = {}
    for item in reply.get("InstanceTypes", []):
        network = item.get("NetworkInfo", {})
        facts[item["InstanceType"]] = TypeFacts(
            instance_type=item["InstanceType"],
            network_cards=int(network.get("MaximumNetworkCards", 1)),
            efa_supported=bool(network.get("EfaSupported", False)),
            max_efa_interfaces=int(network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)),
        )
    return facts


# ---------------------------------------------------------------------------------------------------
# Pure logic: what is wrong with a set of nodes, and the env file. No AWS calls below this line.


def check_nodes(nodes: Sequence[Node], facts: dict[str, TypeFacts]) -> list[str]:  # noqa: C901
    """The problems that would stop a P/D run or slow its KV transfer; empty when all is well."""
    problems: list[str] = []
    for role in ACCELERATED_ROLES:
        if not any(n.role == role for n in nodes):
            problems.append(f"no {role} node (tag {TAG_ROLE}={role})")
    for node in nodes:
        if node.state != "running":
            problems.append(f"{node.name}: state is {node.state}, not running")
        if node.role not in ACCELERATED_ROLES:
            continue
        fact = facts.get(node.instance_type)
        if fact is None:
            problems.append(f"{node.name}: DescribeInstanceTypes knows nothing of {node.instance_type}")
            continue
        if not fact.efa_supported:
            problems.append(f"{node.name}: {node.instance_type} does not support EFA")
            continue
        efa = node.efa_interfaces
        cards = {i.network_card_index for i in efa}
        if len(efa) != fact.network_cards or len(cards) != fact.network_cards:
            problems.append(
                f"{node.name}: {len(efa)} EFA interfaces on {len(cards)} network cards, expected one on each "
                f"of the {fact.network_cards} cards of {node.instance_type}"
            )
        if len(efa) > fact.max_efa_interfaces:
            problems.append(
                f"{node.name}: {len(efa)} EFA interfaces, {node.instance_type} allows {fact.max_efa_interfaces}"
            )
        primary = [i for i in node.interfaces if i.network_card_index == 0 and i.device_index == 0]
        if primary and primary[0].interface_type == "efa-only":
            problems.append(
                f"{node.name}: the primary interface is efa-only; it must be ENA (interface or efa)"
            )
        profile = PROFILES.get(node.instance_type)
        if profile is not None and profile.network_cards != fact.network_cards:
            problems.append(
                f"kvpush's profile of {node.instance_type} says {profile.network_cards} network cards, "
                f"the API says {fact.network_cards}: update kvpush/cluster.py and instance_profiles.tf"
            )
        subnets = {i.subnet_id for i in node.interfaces} - {""}
        if len(subnets) > 1:
            problems.append(f"{node.name}: interfaces in {len(subnets)} subnets; EFA needs them in one")
    accelerated = [n for n in nodes if n.role in ACCELERATED_ROLES]
    subnets = {n.subnet_id for n in accelerated} - {""}
    if len(subnets) > 1:
        problems.append(
            f"prefill and decode nodes are in {len(subnets)} subnets ({', '.join(sorted(subnets))}); EFA needs one"
        )
    zones = {n.availability_zone for n in accelerated} - {""}
    if len(zones) > 1:
        problems.append(f"prefill and decode nodes are in {len(zones)} Availability Zones; EFA needs one")
    return problems


def render_env(
    cluster: str,
    region: str,
    nodes: Sequence[Node],
    ports: dict[str, int],
    tp_size: int | None = None,
    model: str | None = None,
) -> str:
    """The cluster env file (same keys as the Terraform output cluster_env)."""
    by_role: dict[str, list[Node]] = {role: [n for n in nodes if n.role == role] for role in ROLES}
    for role in ACCELERATED_ROLES:
        if not by_role[role]:
            raise ClusterError(f"cluster {cluster!r} has no {role} node: the env file needs one")
    prefill = by_role["prefill"][0]
    profile = PROFILES.get(prefill.instance_type)
    if tp_size is None:
        if profile is None:
            raise ClusterError(f"no default TP size for {prefill.instance_type}: pass --tp-size")
        tp_size = profile.default_tp_size
    lines = {
        "KVPUSH_CLUSTER": cluster,
        "KVPUSH_REGION": region,
        "PREFILL_HOST": prefill.private_ip,
        "DECODE_HOST": by_role["decode"][0].private_ip,
        "PROXY_HOST": by_role["proxy"][0].private_ip if by_role["proxy"] else "",
        "PREFILL_HOSTS": ",".join(n.private_ip for n in by_role["prefill"]),
        "DECODE_HOSTS": ",".join(n.private_ip for n in by_role["decode"]),
        "PROXY_PORT": str(ports["proxy"]),
        "PREFILL_PORT": str(ports["prefill"]),
        "DECODE_PORT": str(ports["decode"]),
        "SIDE_CHANNEL_PORT": str(ports["side_channel"]),
        "PREFILL_TP_SIZE": str(tp_size),
        "PREFILL_PP_SIZE": "1",
        "KV_BUFFER_DEVICE": profile.kv_buffer_device if profile else "cuda",
    }
    if model:
        lines["MODEL"] = model
    header = f"# kvpush cluster {cluster} ({region}), written by `kvpush cluster env`\n"
    return header + "".join(f"{key}={value}\n" for key, value in lines.items())


def format_table(nodes: Sequence[Node]) -> str:
    """The nodes as a rich table (plain columns, no box: it reads in a log and greps by column)."""
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "ROLE", "INSTANCE", "TYPE", "STATE", "PRIVATE IP", "PUBLIC IP", "EFA"):
        table.add_column(column, no_wrap=True)
    for n in nodes:
        efa = str(len(n.efa_interfaces)) if n.role in ACCELERATED_ROLES else "-"
        table.add_row(
            n.name,
            n.role,
            n.instance_id,
            n.instance_type,
            n.state,
            n.private_ip or "-",
            n.public_ip or "-",
            efa,
        )
    out = io.StringIO()
    Console(file=out, width=240, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


# ---------------------------------------------------------------------------------------------------
# Command line


def node_env(path: Path | None = None) -> dict[str, str]:
    """KEY=VALUE pairs of the env file a cluster node's set-up wrote (/etc/kvpush/node.env), so that on
    a node `kvpush cluster` needs no --name or --region. Missing file: empty."""
    path = path or Path(os.environ.get("KVPUSH_NODE_ENV", "/etc/kvpush/node.env"))
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def _default(name: str) -> str | None:
    return os.environ.get(name) or node_env().get(name) or None


def configure(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--name",
        default=_default("KVPUSH_CLUSTER"),
        help="cluster name, the kvpush:cluster tag (default: $KVPUSH_CLUSTER, then /etc/kvpush/node.env)",
    )
    common.add_argument(
        "--region",
        default=_default("KVPUSH_REGION"),
        help="AWS Region (default: $KVPUSH_REGION, then /etc/kvpush/node.env, then the AWS config)",
    )
    common.add_argument("--profile", default=None, help="AWS profile from your AWS config files")

    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("list", parents=[common], help="show each node's role, IP, type and state")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sub.add_parser("check", parents=[common], help="check EFA interfaces per network card, subnet and state")
    p = sub.add_parser("env", parents=[common], help="write the env file the run scripts read")
    p.add_argument(
        "-o", "--output", default="cluster.env", help="file to write, '-' for stdout (default: cluster.env)"
    )
    p.add_argument("--tp-size", type=int, default=None, help="prefill TP size (default: the instance type's)")
    p.add_argument("--model", default=None, help="add MODEL=... to the env file")
    for port, default in DEFAULT_PORTS.items():
        p.add_argument(f"--{port.replace('_', '-')}-port", type=int, default=default, dest=f"{port}_port")
    p = sub.add_parser(
        "key", parents=[common], help="copy the shared HMAC key from Secrets Manager to a file"
    )
    p.add_argument("--secret-id", default=_default(SECRET_ENV), help=f"secret ARN (default: ${SECRET_ENV})")
    p.add_argument("-o", "--output", type=Path, default=Path(DEFAULT_KEY_FILE), help="file (mode 600)")
    p.add_argument("--owner", default=None, help="user to own the file (the one who runs the engines)")
    p = sub.add_parser("upload", parents=[common], help="upload a results folder to S3")
    p.add_argument("results_dir", type=Path, help="folder of result files (e.g. results/)")
    p.add_argument(
        "--bucket",
        default=_default("KVPUSH_RESULTS_BUCKET"),
        help="S3 bucket (default: $KVPUSH_RESULTS_BUCKET, then /etc/kvpush/node.env)",
    )
    p.add_argument("--prefix", default=None, help="key prefix (default: kvpush/<cluster>/<UTC time>)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ClusterError as exc:
        print(f"kvpush cluster: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in ("boto3", "botocore"):
            raise
        print(f"kvpush cluster: boto3 is not installed: {install_command('cluster')}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.action == "upload":
        return _upload(args)
    if args.action == "key":
        print(copy_key(aws_session(args.region, args.profile), args.secret_id, args.output, args.owner))
        return 0
    if not args.name:
        raise ClusterError("no cluster name: pass --name (the stack's `name` variable) or set KVPUSH_CLUSTER")
    session = aws_session(args.region, args.profile)
    nodes = find_nodes(session, args.name)
    if not nodes:
        raise ClusterError(
            f"no nodes tagged {TAG_CLUSTER}={args.name} in {session.region_name}: "
            "check --name and --region against `terraform output`"
        )
    if args.action == "list":
        if args.json:
            print(
                json.dumps([{**asdict(n), "efa_interfaces": len(n.efa_interfaces)} for n in nodes], indent=2)
            )
        else:
            print(format_table(nodes))
        return 0
    if args.action == "check":
        facts = describe_types(session, [n.instance_type for n in nodes if n.role in ACCELERATED_ROLES])
        print(format_table(nodes))
        problems = check_nodes(nodes, facts)
        for problem in problems:
            print(f"PROBLEM {problem}")
        if not problems:
            print(f"ok: {len(nodes)} nodes; every accelerated node has one EFA interface per network card")
        return 1 if problems else 0
    if args.action == "env":
        ports = {name: getattr(args, f"{name}_port") for name in DEFAULT_PORTS}
        text = render_env(args.name, session.region_name, nodes, ports, args.tp_size, args.model)
        if args.output == "-":
            sys.stdout.write(text)
        else:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}", file=sys.stderr)
        return 0
    raise ClusterError(f"unknown action {args.action!r}")


def _upload(args: argparse.Namespace) -> int:
    results: Path = args.results_dir
    if not results.is_dir():
        raise ClusterError(f"{results} is not a folder")
    files = sorted(p for p in results.rglob("*") if p.is_file())
    if not files:
        raise ClusterError(f"{results} holds no files to upload")
    if not args.bucket:
        raise ClusterError("no bucket: pass --bucket or set KVPUSH_RESULTS_BUCKET")
    if not args.prefix and not args.name:
        raise ClusterError("no key prefix: pass --prefix, or --name for the default kvpush/<cluster>/<time>")
    session = aws_session(args.region, args.profile)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    prefix = (args.prefix or f"kvpush/{args.name}/{stamp}").strip("/")
    s3 = session.client("s3")
    for path in files:
        key = f"{prefix}/{path.relative_to(results).as_posix()}"
        aws_call(session.region_name, s3.upload_file, Filename=str(path), Bucket=args.bucket, Key=key)
    print(f"uploaded {len(files)} files to s3://{args.bucket}/{prefix}/")
    return 0
