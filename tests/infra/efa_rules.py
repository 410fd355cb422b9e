"""The EFA rules, checked on tfparse's evaluation of a Terraform configuration.

Each rule returns the violations it finds as readable strings; an empty list means the configuration
follows it. The expected hardware facts come from kvpush.apps.cluster.PROFILES (itself checked against the
Terraform table and EC2's DescribeInstanceTypes data in test_terraform.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpush.apps.cluster import PROFILES

EFA_TYPES = ("efa", "efa-only")
AMI_PARAMETERS = {
    "nvidia": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
    "neuron": "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id",
}

Config = dict[str, Any]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _path(resource: dict[str, Any]) -> str:
    return str(resource.get("__tfmeta", {}).get("path", "?"))


def accelerated_templates(config: Config) -> list[dict[str, Any]]:
    return [lt for lt in config.get("aws_launch_template", []) if lt.get("instance_type") in PROFILES]


def cluster_groups(config: Config) -> set[str]:
    """Ids of the security groups with an all-protocol ingress AND egress rule to themselves."""
    ingress: set[str] = set()
    egress: set[str] = set()
    for rule in config.get("aws_vpc_security_group_ingress_rule", []):
        if rule.get("ip_protocol") in ("-1", "all") and rule.get("referenced_security_group_id") == rule.get(
            "security_group_id"
        ):
            ingress.add(rule["security_group_id"])
    for rule in config.get("aws_vpc_security_group_egress_rule", []):
        if rule.get("ip_protocol") in ("-1", "all") and rule.get("referenced_security_group_id") == rule.get(
            "security_group_id"
        ):
            egress.add(rule["security_group_id"])
    for group in config.get("aws_security_group", []):
        if any(
            r.get("self") is True and str(r.get("protocol")) in ("-1", "all")
            for r in _as_list(group.get("ingress"))
        ):
            ingress.add(group["id"])
        if any(
            r.get("self") is True and str(r.get("protocol")) in ("-1", "all")
            for r in _as_list(group.get("egress"))
        ):
            egress.add(group["id"])
    return ingress & egress


def rule_interfaces_follow_network_cards(config: Config) -> list[str]:
    problems = []
    for lt in accelerated_templates(config):
        name, profile = _path(lt), PROFILES[lt["instance_type"]]
        interfaces = _as_list(lt.get("network_interfaces"))
        efa = [i for i in interfaces if i.get("interface_type") in EFA_TYPES]
        cards = sorted({i.get("network_card_index", 0) for i in efa})
        if len(efa) != profile.network_cards or cards != list(range(profile.network_cards)):
            problems.append(
                f"{name}: {len(efa)} EFA interfaces on cards {cards}, expected one on each of the "
                f"{profile.network_cards} network cards of {lt['instance_type']}"
            )
        slots = [(i.get("network_card_index", 0), i.get("device_index", 0)) for i in interfaces]
        if len(slots) != len(set(slots)):
            problems.append(f"{name}: two interfaces share a (network card, device index) slot")
        primary = [
            i for i in interfaces if i.get("network_card_index", 0) == 0 and i.get("device_index", 0) == 0
        ]
        if len(primary) != 1 or primary[0].get("interface_type") not in ("interface", "efa"):
            problems.append(
                f"{name}: the primary interface (card 0, device 0) must be ENA ('interface' or 'efa')"
            )
        others = [i for i in interfaces if i not in primary]
        kinds = {i.get("interface_type") for i in others}
        if primary and primary[0].get("interface_type") == "interface" and kinds != {"efa-only"}:
            problems.append(
                f"{name}: with an ENA-only primary every other interface must be efa-only, got {sorted(map(str, kinds))}"
            )
        if len(interfaces) not in (profile.network_cards, profile.network_cards + 1):
            problems.append(f"{name}: {len(interfaces)} interfaces for {profile.network_cards} network cards")
    return problems


def rule_single_subnet(config: Config) -> list[str]:
    problems = []
    # the NAT gateway's own small public subnet (private nodes' egress) holds no node
    nat = bool(config.get("aws_nat_gateway"))
    subnets = [
        s
        for s in config.get("aws_subnet", [])
        if not (nat and str((s.get("tags") or {}).get("Name", "")).endswith("-nat"))
    ]
    if len(subnets) > 1:
        problems.append(f"{len(subnets)} subnets: the cluster must live in one")
    used = set()
    for lt in config.get("aws_launch_template", []):
        for interface in _as_list(lt.get("network_interfaces")):
            used.add(str(interface.get("subnet_id")))
    if len(used) > 1:
        problems.append(f"the launch templates' interfaces use {len(used)} different subnets; EFA needs one")
    if "None" in used:
        problems.append("an interface has no subnet_id")
    return problems


def rule_security_group_self(config: Config) -> list[str]:
    problems = []
    groups = cluster_groups(config)
    if not groups:
        problems.append("no security group allows all protocols in AND out with itself (EFA needs both)")
    for lt in accelerated_templates(config):
        for interface in _as_list(lt.get("network_interfaces")):
            if not groups & set(_as_list(interface.get("security_groups"))):
                problems.append(
                    f"{_path(lt)}: interface on card {interface.get('network_card_index', 0)} device "
                    f"{interface.get('device_index', 0)} lacks the self-referencing security group"
                )
    return problems


def rule_no_open_ingress(config: Config) -> list[str]:
    return [
        f"{_path(r)}: ingress open to {r.get('cidr_ipv4') or r.get('cidr_ipv6')}"
        for r in config.get("aws_vpc_security_group_ingress_rule", [])
        if r.get("cidr_ipv4") == "0.0.0.0/0" or r.get("cidr_ipv6") == "::/0"
    ]


def rule_imdsv2(config: Config) -> list[str]:
    problems = []
    for lt in config.get("aws_launch_template", []):
        options = _as_list(lt.get("metadata_options"))
        if not options or options[0].get("http_tokens") != "required":
            problems.append(f"{_path(lt)}: IMDSv2 not required (metadata_options.http_tokens)")
    return problems


def rule_encrypted_gp3_root(config: Config) -> list[str]:
    problems = []
    for lt in config.get("aws_launch_template", []):
        mappings = _as_list(lt.get("block_device_mappings"))
        if not mappings:
            problems.append(f"{_path(lt)}: no root volume mapping (encryption and gp3 left to the AMI)")
        for mapping in mappings:
            for ebs in _as_list(mapping.get("ebs")):
                if ebs.get("encrypted") is not True or ebs.get("volume_type") != "gp3":
                    problems.append(
                        f"{_path(lt)}: {mapping.get('device_name')} is "
                        f"{ebs.get('volume_type')} encrypted={ebs.get('encrypted')}, expected encrypted gp3"
                    )
    return problems


def rule_cluster_placement(config: Config) -> list[str]:
    groups = {pg.get("name"): pg for pg in config.get("aws_placement_group", [])}
    problems = [
        f"{_path(pg)}: strategy {pg.get('strategy')!r}, expected 'cluster'"
        for pg in groups.values()
        if pg.get("strategy") != "cluster"
    ]
    for lt in accelerated_templates(config):
        markets = _as_list(lt.get("instance_market_options"))
        capacity_block = any(m.get("market_type") == "capacity-block" for m in markets)
        placement = _as_list(lt.get("placement"))
        group = placement[0].get("group_name") if placement else None
        if capacity_block:
            if group:
                problems.append(f"{_path(lt)}: a Capacity Block launch must not name a placement group")
        elif not group:
            problems.append(f"{_path(lt)}: not launched into a placement group")
        elif group in groups and groups[group].get("strategy") != "cluster":
            problems.append(f"{_path(lt)}: launched into {group!r}, which is not a cluster placement group")
        # A group named but not defined here is an existing one (an ODCR's); its strategy is the user's.
    return problems


def rule_ami_per_accelerator(config: Config) -> list[str]:
    problems = []
    parameters = {p.get("name") for p in config.get("aws_ssm_parameter", [])}
    for lt in accelerated_templates(config):
        expected = AMI_PARAMETERS[PROFILES[lt["instance_type"]].accelerator]
        if expected not in parameters:
            problems.append(f"{_path(lt)}: the AMI of {lt['instance_type']} should come from SSM {expected}")
    return problems


def rule_capacity_reservation(config: Config) -> list[str]:
    problems = []
    for lt in accelerated_templates(config):
        markets = _as_list(lt.get("instance_market_options"))
        if any(m.get("market_type") == "capacity-block" for m in markets):
            targets = [
                t
                for spec in _as_list(lt.get("capacity_reservation_specification"))
                for t in _as_list(spec.get("capacity_reservation_target"))
            ]
            if not any(str(t.get("capacity_reservation_id", "")).startswith("cr-") for t in targets):
                problems.append(f"{_path(lt)}: capacity-block market without a capacity reservation target")
    return problems


RULES: dict[str, Callable[[Config], list[str]]] = {
    "interfaces": rule_interfaces_follow_network_cards,
    "single_subnet": rule_single_subnet,
    "security_group_self": rule_security_group_self,
    "no_open_ingress": rule_no_open_ingress,
    "imdsv2": rule_imdsv2,
    "encrypted_gp3_root": rule_encrypted_gp3_root,
    "cluster_placement": rule_cluster_placement,
    "ami_per_accelerator": rule_ami_per_accelerator,
    "capacity_reservation": rule_capacity_reservation,
}


def violations(config: Config) -> dict[str, list[str]]:
    """Every rule's violations, only for rules that found some."""
    found = {name: rule(config) for name, rule in RULES.items()}
    return {name: problems for name, problems in found.items() if problems}
