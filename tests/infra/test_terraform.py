"""Offline checks of terraform/: formatting, evaluation of every stack with its example tfvars, the EFA
rules, the instance-profile table against EC2's own data, the rendered node set-up scripts."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpush.apps.cluster import PROFILES
from tests.infra import efa_rules
from tests.infra.infra_tools import (
    FIXTURES,
    MODULE_DIR,
    ROOT,
    STACKS,
    TERRAFORM_DIR,
    fmt_terraform,
    infra_tool,
    load_config,
    load_stack,
    module_locals,
    python_dep,
    render_template,
    run,
)


@pytest.fixture(scope="module")
def stacks() -> dict[str, dict[str, Any]]:
    return {name: load_stack(name) for name in STACKS}


def _interfaces(template: dict[str, Any]) -> list[dict[str, Any]]:
    return efa_rules._as_list(template.get("network_interfaces"))


# --- formatting and parsing -------------------------------------------------------------------------


def test_terraform_fmt_check() -> None:
    terraform, version = fmt_terraform()
    proc = run([terraform, "fmt", "-check", "-recursive", "-diff", str(TERRAFORM_DIR)])
    assert proc.returncode == 0, (
        f"terraform fmt ({terraform} {version}) wants changes; run `terraform fmt -recursive terraform`:\n"
        f"{proc.stdout}{proc.stderr}"
    )


def test_terraform_binary_is_1_0_3() -> None:
    """.venv-infra's Terraform (templatefile rendering, and fmt where no newer one is installed)."""
    proc = run([infra_tool("terraform"), "version"])
    assert "Terraform v1.0.3" in proc.stdout


def test_example_tfvars_are_formatted(tmp_path: Path) -> None:
    # fmt only looks at .tf/.tfvars; the examples are copied under a name it checks.
    for stack in STACKS:
        shutil.copy(
            TERRAFORM_DIR / "stacks" / stack / "terraform.tfvars.example", tmp_path / f"{stack}.tfvars"
        )
    for fixture in FIXTURES.glob("*.tfvars"):
        shutil.copy(fixture, tmp_path / fixture.name)
    proc = run([fmt_terraform()[0], "fmt", "-check", "-diff", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout


def test_fmt_and_tfparse_reject_a_syntax_error() -> None:
    tfparse = python_dep("tfparse")
    proc = run([infra_tool("terraform"), "fmt", "-check", str(FIXTURES / "syntax_error")])
    assert proc.returncode != 0
    with pytest.raises(tfparse.ParseError, match="Unclosed configuration block"):
        load_config(FIXTURES / "syntax_error")


def test_every_terraform_folder_parses() -> None:
    """A file tfparse cannot parse anywhere under terraform/ fails here (it would otherwise be dropped)."""
    folders = sorted({p.parent for p in TERRAFORM_DIR.rglob("*.tf") if ".terraform" not in p.parts})
    assert folders, "no Terraform found"
    for folder in folders:
        load_config(folder)


# --- each stack with its example tfvars -------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_stack_follows_the_efa_rules(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    assert efa_rules.violations(stacks[stack]) == {}


@pytest.mark.parametrize("stack", STACKS)
def test_stack_builds_one_prefill_one_decode_one_proxy(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    config = stacks[stack]
    paths = sorted(i["__tfmeta"]["path"] for i in config["aws_instance"])
    assert paths == [
        'module.cluster.aws_instance.accelerated["decode-0"]',
        'module.cluster.aws_instance.accelerated["prefill-0"]',
        "module.cluster.aws_instance.proxy[0]",
    ]
    roles = sorted(i["tags"]["kvpush:role"] for i in config["aws_instance"])
    assert roles == ["decode", "prefill", "proxy"]
    assert {i["tags"]["kvpush:cluster"] for i in config["aws_instance"]} == {f"kvpush-{stack}"}


@pytest.mark.parametrize("stack", STACKS)
def test_interfaces_equal_network_cards(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    for template in efa_rules.accelerated_templates(stacks[stack]):
        cards = PROFILES[template["instance_type"]].network_cards
        interfaces = _interfaces(template)
        # ENA primary + one EFA-only interface on every card (card 0 carries it at device index 1).
        assert len(interfaces) == cards + 1
        assert [
            (i["network_card_index"], i["device_index"], i["interface_type"]) for i in interfaces[:2]
        ] == [
            (0, 0, "interface"),
            (0, 1, "efa-only"),
        ]
        assert [i["interface_type"] for i in interfaces[1:]] == ["efa-only"] * cards
        assert sorted(i["network_card_index"] for i in interfaces[1:]) == list(range(cards))
        assert {i["device_index"] for i in interfaces[2:]} == {0}
        assert all(i["delete_on_termination"] is True for i in interfaces)


@pytest.mark.parametrize("stack", STACKS)
def test_launch_templates_harden_the_nodes(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    config = stacks[stack]
    templates = config["aws_launch_template"]
    assert len(templates) == 3
    for template in templates:
        assert template["metadata_options"]["http_tokens"] == "required"
        assert template["metadata_options"]["http_put_response_hop_limit"] == 1
        ebs = template["block_device_mappings"]["ebs"]
        assert ebs["encrypted"] is True and ebs["volume_type"] == "gp3"
        assert template["block_device_mappings"]["device_name"] == "/dev/sda1"
    subnets = {str(i["subnet_id"]) for t in templates for i in _interfaces(t)}
    assert len(subnets) == 1
    (subnet,) = [
        s for s in config["aws_subnet"] if s["__tfmeta"]["path"] == "module.network.aws_subnet.cluster[0]"
    ]
    assert subnet["map_public_ip_on_launch"] is False


@pytest.mark.parametrize("stack", STACKS)
def test_security_groups(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    config = stacks[stack]
    groups = {g["__tfmeta"]["path"].rsplit(".", 1)[1]: g["id"] for g in config["aws_security_group"]}
    assert efa_rules.cluster_groups(config) == {groups["cluster"]}
    client_rules = [
        r for r in config["aws_vpc_security_group_ingress_rule"] if r["security_group_id"] == groups["client"]
    ]
    assert sorted((r["from_port"], r["cidr_ipv4"]) for r in client_rules) == [
        (22, "203.0.113.10/32"),
        (8000, "203.0.113.10/32"),
    ]
    for template in efa_rules.accelerated_templates(config):
        for interface in _interfaces(template):
            expected = (
                {groups["cluster"], groups["client"]}
                if interface["interface_type"] == "interface"
                else {groups["cluster"]}
            )
            assert set(interface["security_groups"]) == expected


@pytest.mark.parametrize("stack", STACKS)
def test_placement_group_is_cluster(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    config = stacks[stack]
    (group,) = config["aws_placement_group"]
    assert group["strategy"] == "cluster"
    for template in efa_rules.accelerated_templates(config):
        assert template["placement"]["group_name"] == group["name"]


@pytest.mark.parametrize("stack", STACKS)
def test_ami_comes_from_the_accelerators_ssm_parameter(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    config = stacks[stack]
    (template, *_) = efa_rules.accelerated_templates(config)
    accelerator = PROFILES[template["instance_type"]].accelerator
    names = sorted(p["name"] for p in config["aws_ssm_parameter"])
    assert efa_rules.AMI_PARAMETERS[accelerator] in names
    assert "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id" in names
    other = {"nvidia": "neuron", "neuron": "nvidia"}[accelerator]
    assert efa_rules.AMI_PARAMETERS[other] not in names


# --- other inputs -----------------------------------------------------------------------------------


def test_capacity_block_targets_the_reservation_without_placement_group() -> None:
    config = load_config(TERRAFORM_DIR / "stacks" / "p5en", FIXTURES / "capacity_block.tfvars")
    assert efa_rules.violations(config) == {}
    assert config.get("aws_placement_group", []) == []
    for template in efa_rules.accelerated_templates(config):
        assert template["instance_market_options"]["market_type"] == "capacity-block"
        target = template["capacity_reservation_specification"]["capacity_reservation_target"]
        assert target["capacity_reservation_id"] == "cr-0123456789abcdef0"
        assert template.get("placement") is None


def test_trn1n_gets_sixteen_efa_interfaces_and_two_prefills() -> None:
    config = load_config(TERRAFORM_DIR / "stacks" / "trn1", FIXTURES / "trn1n.tfvars")
    assert efa_rules.violations(config) == {}
    for template in efa_rules.accelerated_templates(config):
        assert template["instance_type"] == "trn1n.32xlarge"
        assert sum(i["interface_type"] == "efa-only" for i in _interfaces(template)) == 16
    roles = sorted(i["tags"]["kvpush:role"] for i in config["aws_instance"])
    assert roles == ["decode", "prefill", "prefill", "proxy"]


def test_existing_network_and_odcr_placement_group() -> None:
    config = load_config(TERRAFORM_DIR / "stacks" / "trn2", FIXTURES / "existing_network.tfvars")
    assert efa_rules.violations(config) == {}
    created = [
        r
        for kind in ("aws_vpc", "aws_internet_gateway", "aws_placement_group", "aws_eip")
        for r in config.get(kind, [])
    ]
    assert created == []
    for template in efa_rules.accelerated_templates(config):
        assert template["placement"]["group_name"] == "my-odcr-pg"
        assert (
            template["capacity_reservation_specification"]["capacity_reservation_target"][
                "capacity_reservation_id"
            ]
            == "cr-0fedcba9876543210"
        )
        assert {str(i["subnet_id"]) for i in _interfaces(template)} == {"subnet-0123456789abcdef0"}


def test_the_broken_fixture_breaks_every_rule() -> None:
    found = efa_rules.violations(load_config(FIXTURES / "broken"))
    assert set(found) == set(efa_rules.RULES) - {"capacity_reservation"}
    assert any("2 EFA interfaces" in p and "16 network cards" in p for p in found["interfaces"])
    assert any("primary interface" in p for p in found["interfaces"])
    assert any("2 different subnets" in p for p in found["single_subnet"])
    assert any("in AND out with itself" in p for p in found["security_group_self"])


# --- the instance profile table ---------------------------------------------------------------------


def test_instance_profiles_agree_with_ec2_and_kvpush(stacks: dict[str, dict[str, Any]]) -> None:
    moto = python_dep("moto")
    snapshot = Path(moto.__file__).parent / "ec2" / "resources" / "instance_types.json.gz"
    ec2_types = json.loads(gzip.decompress(snapshot.read_bytes()))
    table = module_locals(stacks["p5en"])["instance_profiles"]
    assert set(table) == set(PROFILES)
    for name, entry in table.items():
        network = ec2_types[name]["NetworkInfo"]
        assert entry["network_cards"] == network["MaximumNetworkCards"], name
        assert entry["max_efa_interfaces"] == network["EfaInfo"]["MaximumEfaInterfaces"], name
        assert network["EfaSupported"] is True
        accelerators = (
            ec2_types[name].get("GpuInfo", {}).get("Gpus") or ec2_types[name]["NeuronInfo"]["NeuronDevices"]
        )
        assert entry["accelerator_count"] == accelerators[0]["Count"], name
        assert entry["accelerator_name"] == accelerators[0]["Name"], name
        assert entry["ami_ssm_parameter"] == efa_rules.AMI_PARAMETERS[entry["accelerator"]]
        profile = PROFILES[name]
        assert (
            profile.network_cards,
            profile.accelerator,
            profile.accelerator_count,
            profile.default_tp_size,
            profile.kv_buffer_device,
        ) == (
            entry["network_cards"],
            entry["accelerator"],
            entry["accelerator_count"],
            entry["default_tp_size"],
            entry["kv_buffer_device"],
        ), name


def test_instance_type_validation_lists_the_profiles() -> None:
    text = (MODULE_DIR / "variables.tf").read_text()
    block = text[text.index('variable "instance_type"') :]
    listed = re.search(r"contains\(\[([^\]]*)\], var\.instance_type\)", block)
    assert listed is not None
    assert sorted(re.findall(r'"([^"]+)"', listed.group(1))) == sorted(PROFILES)


def test_every_variable_has_a_description_and_type() -> None:
    for path in TERRAFORM_DIR.rglob("variables.tf"):
        for block in re.split(r'\n(?=variable ")', path.read_text()):
            if block.startswith("variable "):
                assert "description" in block and "type" in block, f"{path}: {block.splitlines()[0]}"


# --- the node set-up scripts (user data) ------------------------------------------------------------


def _setup_scripts(stack: dict[str, Any]) -> dict[str, str]:
    node_setup = module_locals(stack)["node_setup"]
    accelerator = module_locals(stack)["profile"]["accelerator"]
    template = MODULE_DIR / "templates" / "node-setup.sh.tftpl"
    return {
        role: render_template(
            template, {**node_setup, "role": role, "accelerator": "none" if role == "proxy" else accelerator}
        )
        for role in ("prefill", "decode", "proxy")
    }


def test_setup_script_inputs_are_fully_evaluated(stacks: dict[str, dict[str, Any]]) -> None:
    for stack in stacks.values():
        node_setup = module_locals(stack)["node_setup"]
        assert all(not isinstance(v, dict) for v in node_setup.values()), node_setup


@pytest.mark.parametrize("stack", ["p5en", "trn2"])
def test_setup_scripts_render_and_pass_shellcheck(
    stacks: dict[str, dict[str, Any]], stack: str, tmp_path: Path
) -> None:
    scripts = _setup_scripts(stacks[stack])
    shellcheck = infra_tool("shellcheck")
    for role, script in scripts.items():
        assert script.startswith("#!/bin/bash\n")
        assert f'readonly ROLE="{role}"' in script
        assert "%{" not in script and "${" not in script.replace("${Version}", "")
        path = tmp_path / f"{stack}-{role}.sh"
        path.write_text(script)
        assert run(["bash", "-n", str(path)]).returncode == 0
        proc = run([shellcheck, "-s", "bash", "-S", "warning", str(path)])
        assert proc.returncode == 0, f"{stack} {role}:\n{proc.stdout}"
    accelerated = scripts["prefill"]
    assert "fi_info -p efa -t FI_EP_RDM" in accelerated and "KVPUSH_EFA_EXPECTED=16" in accelerated
    assert "aws-efa-installer-1.50.0.tar.gz" in accelerated
    if stack == "p5en":
        assert "nvidia-smi -L" in accelerated and "neuron-ls" not in accelerated
    else:
        assert (
            "neuron-ls" in accelerated
            and "aws-neuronx-runtime-lib" in accelerated
            and "nvidia-smi" not in accelerated
        )
    assert "fi_info" not in scripts["proxy"] and 'install_kvpush "$VENV" proxy,cluster' in scripts["proxy"]
    # the proxy node gets the proxy extra only: no vLLM, NIXL, torch or test tools
    proxy_only = scripts["proxy"][
        scripts["proxy"].index("# ---- Proxy") : scripts["proxy"].index("# ---- The shared")
    ]
    for heavy in ("vllm", "nixl", "torch", "bench", "infra", "test"):
        assert heavy not in proxy_only.lower().split("# ---- proxy", 1)[-1].split("\n", 3)[-1], heavy


def test_cluster_env_output_has_the_keys_the_scripts_read() -> None:
    outputs = (MODULE_DIR / "outputs.tf").read_text()
    keys = set(re.findall(r"^\s+([A-Z_]+)=", outputs[outputs.index('output "cluster_env"') :], re.M))
    scripts = (ROOT / "scripts" / "serve_pd.sh").read_text() + (ROOT / "scripts" / "run_sweep.sh").read_text()
    for key in (
        "PREFILL_HOST",
        "DECODE_HOST",
        "PREFILL_PORT",
        "DECODE_PORT",
        "PROXY_PORT",
        "SIDE_CHANNEL_PORT",
        "PREFILL_TP_SIZE",
        "PREFILL_PP_SIZE",
        "MODEL",
        "KV_BUFFER_DEVICE",
    ):
        assert key in keys
        assert key in scripts


def test_node_role_allows_every_call_kvpush_cluster_makes(stacks: dict[str, dict[str, Any]]) -> None:
    source = (ROOT / "kvpush" / "apps" / "cluster.py").read_text()
    calls = set(re.findall(r'"(describe_[a-z_]+)"', source)) | set(
        re.findall(r"ec2\.(describe_[a-z_]+)", source)
    )
    assert calls == {"describe_instances", "describe_network_interfaces", "describe_instance_types"}
    wanted = {"ec2:" + "".join(part.capitalize() for part in call.split("_")) for call in calls}
    (policy,) = [
        p for p in stacks["p5en"]["aws_iam_role_policy"] if p["__tfmeta"]["path"].endswith(".discover")
    ]
    actions = {a for statement in json.loads(policy["policy"])["Statement"] for a in statement["Action"]}
    assert wanted <= actions
