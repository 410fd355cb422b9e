"""The engines run under systemd on the cluster path: the node set-up (the Terraform template) writes one
unit per role that restarts on failure, lifts memlock, logs to journald, runs as the node user and starts
only when the key file is that user's alone; `systemd-analyze verify` accepts every rendered unit."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.infra.infra_tools import load_stack, module_locals, render_template
from tests.infra.test_terraform import MODULE_DIR

SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def _units(stack: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """Each role's unit as the set-up script writes it (its shell variables filled in as on a node)."""
    node_setup = module_locals(stack)["node_setup"]
    accelerator = module_locals(stack)["profile"]["accelerator"]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    home = tmp_path / "kvpush"
    script = home / "src" / "scripts" / "serve_pd.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    units = {}
    for role in ("prefill", "decode", "proxy"):
        text = render_template(
            MODULE_DIR / "templates" / "node-setup.sh.tftpl",
            {**node_setup, "role": role, "accelerator": "none" if role == "proxy" else accelerator},
        )
        body = text[text.index("# BEGIN kvpush unit\n") : text.index("# END kvpush unit\n")]
        # the unquoted heredoc's expansions, as bash makes them on the node
        for name, value in (
            ("ROLE", role),
            ("VENV", str(venv)),
            ("KVPUSH_HOME", str(home)),
            ("ENV_FILE", "/etc/kvpush/node.env"),
        ):
            body = re.sub(r"\$" + name + r"\b", value, body)
        units[role] = body.replace("\\$", "$")
    return units


@pytest.fixture(scope="module")
def p5en() -> dict[str, Any]:
    return load_stack("p5en")


def test_every_role_has_a_supervised_unit(p5en: dict[str, Any], tmp_path: Path) -> None:
    for role, unit in _units(p5en, tmp_path).items():
        lines = set(unit.splitlines())
        for needed in (
            "Restart=on-failure",
            "LimitMEMLOCK=infinity",
            "StandardOutput=journal",
            "StandardError=journal",
            f"SyslogIdentifier=kvpush-{role}",
            "User=ubuntu",
            "WantedBy=multi-user.target",
        ):
            assert needed in lines, f"{role}: {needed}"
        assert "ExecStartPre=/usr/bin/test -r /etc/kvpush/hmac.key" in lines
        assert "stat -c %%a /etc/kvpush/hmac.key" in unit  # mode 600: the service user's alone
        assert f"Environment=ROLE={role} MODE=push CONNECTOR=kvpush FOREGROUND=1" in unit
        assert re.search(r"^ExecStart=\S+/scripts/serve_pd\.sh$", unit, re.M), role
        # the proxy reads the engines' addresses from cluster.env (`kvpush cluster env`)
        assert ("ConditionPathExists=/etc/kvpush/cluster.env" in lines) == (role == "proxy"), role


def test_systemd_analyze_verifies_the_rendered_units(p5en: dict[str, Any], tmp_path: Path) -> None:
    if not Path(SYSTEMD_ANALYZE).exists():
        pytest.fail(
            f"{SYSTEMD_ANALYZE} is missing: install systemd (it provides systemd-analyze) in the test set-up"
        )
    for role, unit in _units(p5en, tmp_path).items():
        path = tmp_path / f"kvpush-{role}.service"
        path.write_text(unit)
        proc = subprocess.run(
            [SYSTEMD_ANALYZE, "verify", "--man=no", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        # verify names missing ExecStart binaries and unknown keys; nothing may be said about this unit
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if path.name in line]
        assert proc.returncode == 0 and not said, f"{role}:\n{proc.stdout}{proc.stderr}"


def test_the_foreground_mode_execs_the_command() -> None:
    text = (Path(__file__).parents[2] / "scripts" / "serve_pd.sh").read_text()
    block = text[text.index('if [ "${FOREGROUND:-0}" = 1 ]; then') :]
    assert block.split("\n", 2)[1].strip() == 'exec "${CMD[@]}"'
    assert text.index("FOREGROUND:-0") < text.index("pid_file=$RUN_DIR")
