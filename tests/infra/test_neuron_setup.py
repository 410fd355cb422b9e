"""The Neuron part of the node set-up (user data), rendered by Terraform's templatefile for the trn2 and
trn1 stacks: the checks it runs, what it writes into the node env, the install path that keeps the
DLAMI's NIXL and torch, and what the trn1 stack says about vLLM Neuron."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.infra.infra_tools import (
    MODULE_DIR,
    TERRAFORM_DIR,
    infra_tool,
    load_stack,
    module_locals,
    render_template,
    run,
)

CHECK_CALL = '"$KVPUSH_HOME/src/scripts/neuron_node_check.py" --env-file "$ENV_FILE"'


def _render(stack: str, role: str = "prefill") -> str:
    config: dict[str, Any] = load_stack(stack)
    loc = module_locals(config)
    accelerator = "none" if role == "proxy" else loc["profile"]["accelerator"]
    return render_template(
        MODULE_DIR / "templates" / "node-setup.sh.tftpl",
        {**loc["node_setup"], "role": role, "accelerator": accelerator},
    )


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return {stack: _render(stack) for stack in ("trn2", "trn1")}


@pytest.mark.parametrize("stack", ["trn2", "trn1"])
def test_neuron_setup_renders_and_passes_shellcheck(
    scripts: dict[str, str], stack: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{stack}.sh"
    path.write_text(scripts[stack])
    assert run(["bash", "-n", str(path)]).returncode == 0
    proc = run([infra_tool("shellcheck"), "-s", "bash", "-S", "warning", str(path)])
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("stack", ["trn2", "trn1"])
def test_neuron_setup_installs_through_the_protecting_script_and_runs_the_checks(
    scripts: dict[str, str], stack: str
) -> None:
    s = scripts[stack]
    neuron = s[s.index("# ---- Neuron") :]
    assert '"$KVPUSH_HOME/src/scripts/neuron_install.sh" "$VENV" "$KVPUSH_HOME/src" bench' in neuron
    assert 'pip install --quiet "$KVPUSH_HOME/src' not in neuron  # never a plain install into the DLAMI venv
    check = neuron[neuron.index(CHECK_CALL) :]
    assert '--neuron-devices "$NEURON_DEVICES" --efa-found "$EFA_FOUND"' in check
    assert 'tee -a "$STATUS_FILE"' in check and "FAILED=1" in check
    assert neuron.index("FI_EFA_ENABLE_SHM_TRANSFER=0") < neuron.index(CHECK_CALL)  # env first
    assert "LD_LIBRARY_PATH=$LIB_PATH" in neuron and "/opt/aws/neuron/lib:/opt/amazon/efa/lib" in neuron
    assert "neuronx-cc" in neuron  # the pip fallback brings the compiler vllm-neuron does not depend on


def test_nvidia_and_proxy_setups_are_not_given_the_neuron_steps() -> None:
    for script in (_render("p5en"), _render("trn2", "proxy")):
        assert "neuron_install.sh" not in script and "FI_EFA_ENABLE_SHM_TRANSFER" not in script


def test_trn1_says_vllm_neuron_does_not_support_it(scripts: dict[str, str]) -> None:
    assert "KVPUSH_VLLM_NEURON=unsupported" in scripts["trn1"]
    assert "Trn2/Trn3 only" in scripts["trn1"]
    assert "KVPUSH_VLLM_NEURON" not in scripts["trn2"]
    stack_doc = (TERRAFORM_DIR / "stacks" / "trn1" / "main.tf").read_text()
    assert "Trn2 and Trn3 only" in stack_doc and "not for vLLM push-vs-pull" in stack_doc
