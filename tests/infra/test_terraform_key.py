"""The shared HMAC key in terraform/ (issue 17): generated into a Secrets Manager secret, readable by the
node role alone, copied by every node's set-up into the file scripts/serve_pd.sh reads, and never in user
data or an output. tfparse's evaluation of each stack and the rendered set-up scripts; the module's
`terraform test` (tests/efa_cluster.tftest.hcl) checks the same on Terraform's own plan."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvpush.apps.cluster_key import DEFAULT_KEY_FILE, SECRET_ENV
from tests.infra.infra_tools import MODULE_DIR, ROOT, STACKS, TERRAFORM_DIR, load_stack, module_locals
from tests.infra.test_terraform import _setup_scripts


@pytest.fixture(scope="module")
def stacks() -> dict[str, dict[str, Any]]:
    return {name: load_stack(name) for name in STACKS}


def _serve_pd_key_file() -> str:
    found = re.search(
        r"^HMAC_KEY_FILE=\$\{HMAC_KEY_FILE:-([^}]+)\}$", (ROOT / "scripts" / "serve_pd.sh").read_text(), re.M
    )
    assert found, "serve_pd.sh no longer defaults HMAC_KEY_FILE"
    return found[1]


@pytest.mark.parametrize("stack", STACKS)
def test_the_key_is_a_secret_only_the_node_role_may_read(
    stacks: dict[str, dict[str, Any]], stack: str
) -> None:
    config = stacks[stack]
    (secret,) = config["aws_secretsmanager_secret"]
    assert secret["name"] == f"kvpush-{stack}/kvpush-hmac-key" and secret["recovery_window_in_days"] == 0
    assert secret["kms_key_id"] is None  # the account's aws/secretsmanager KMS key unless one is given
    (version,) = config["aws_secretsmanager_secret_version"]
    assert version["secret_id"] == secret["id"]
    assert version["secret_string"]["__ref__"] == "aws_secretsmanager_random_password.hmac_key"
    (generator,) = config["aws_secretsmanager_random_password"]
    # letters and digits, a multiple of 4 long: valid base64 as it is, of >= 16 bytes
    assert generator["exclude_punctuation"] is True and generator["include_space"] is False
    assert generator["password_length"] % 4 == 0 and generator["password_length"] * 3 // 4 >= 32

    (role,) = config["aws_iam_role"]
    policies = {p["__tfmeta"]["path"].rsplit(".", 1)[1]: p for p in config["aws_iam_role_policy"]}
    assert policies["hmac_key"]["role"] == role["id"]
    assert json.loads(policies["hmac_key"]["policy"])["Statement"] == [
        {
            "Sid": "ReadTheClusterKey",
            "Effect": "Allow",
            "Action": ["secretsmanager:GetSecretValue"],
            "Resource": secret["id"],
        }
    ]
    # no other grant in the stack touches Secrets Manager (a wildcard would let it read the key)
    for name, policy in policies.items():
        if name != "hmac_key":
            assert "secretsmanager" not in policy["policy"] and "kms:" not in policy["policy"], name


@pytest.mark.parametrize("stack", STACKS)
def test_the_set_up_names_the_secret_and_the_file_serve_pd_reads(
    stacks: dict[str, dict[str, Any]], stack: str
) -> None:
    node_setup = module_locals(stacks[stack])["node_setup"]
    assert node_setup["hmac_key_secret"] == f"kvpush-{stack}/kvpush-hmac-key"
    assert node_setup["hmac_key_file"] == DEFAULT_KEY_FILE == _serve_pd_key_file()
    assert node_setup["node_user"] == "ubuntu"


def test_every_role_copies_the_key_into_the_file_after_installing_kvpush(
    stacks: dict[str, dict[str, Any]],
) -> None:
    for stack in ("p5en", "trn2"):
        for role, script in _setup_scripts(stacks[stack]).items():
            copy = script.index(
                f'cluster key --region "$REGION" --secret-id "kvpush-{stack}/kvpush-hmac-key"'
            )
            assert '--output "$HMAC_KEY_FILE" --owner "ubuntu"' in script[copy:]
            assert f'readonly HMAC_KEY_FILE="{DEFAULT_KEY_FILE}"' in script
            # boto3 (kvpush's cluster extra) is installed before the copy, on every kind of node
            install = re.search(
                r"(install_kvpush \"\$VENV\"|neuron_install.sh\" \"\$VENV\" \"\$KVPUSH_HOME/src\") ([a-z,]+)",
                script,
            )
            assert install and install.start() < copy, (stack, role)
            assert set(install[2].split(",")) & {"cluster", "infra"}, (stack, role, install[2])
            # serve_pd.sh and `kvpush cluster key` on the node find both through node.env
            env_block = script[script.index('cat >> "$ENV_FILE" <<ENV\nHMAC_KEY_FILE') :]
            assert f"KVPUSH_HMAC_KEY_SECRET=kvpush-{stack}/kvpush-hmac-key" in env_block.split("\nENV\n")[0]
            assert SECRET_ENV == "KVPUSH_HMAC_KEY_SECRET"
            assert "random_password" not in script and "secret_string" not in script


def test_no_output_or_user_data_can_hold_the_key() -> None:
    """The generated password is referenced once, by the secret's version; no output, local or template
    can reach it, and the module's only Secrets Manager output is the secret's ARN."""
    uses = [
        (path.relative_to(TERRAFORM_DIR), line.strip())
        for path in sorted(TERRAFORM_DIR.rglob("*.tf"))
        for line in path.read_text().splitlines()
        if not line.lstrip().startswith("#")
        and re.search(r"random_password\.|secret_string|aws_secretsmanager_secret_version\.", line)
    ]
    assert uses == [
        (MODULE_DIR.relative_to(TERRAFORM_DIR) / "secrets.tf", line)
        for line in (
            "secret_string = data.aws_secretsmanager_random_password.hmac_key.random_password",
            "ignore_changes = [secret_string]",
        )
    ]
    template = (MODULE_DIR / "templates" / "node-setup.sh.tftpl").read_text()
    assert "hmac_key_secret" in template and not re.search(r"\$\{[^}]*(password|secret_string)", template)
    outputs = (MODULE_DIR / "outputs.tf").read_text()
    assert re.findall(r"aws_secretsmanager_secret\.\w+\.(\w+)", outputs) == ["arn"]
