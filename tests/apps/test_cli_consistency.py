"""One CLI: every subcommand's --help runs and lists every flag it accepts (no hidden aliases), a usage
error exits 2 with the command's prefix, and `--json` means the same everywhere (print JSON on stdout;
`--output PATH` writes it)."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush import cli
from kvpush.apps import cliutil


def _parsers(name: str) -> list[argparse.ArgumentParser]:
    parser = cli.Parser(prog=f"kvpush {name}")
    importlib.import_module(cli.COMMANDS[name].module).configure(parser)
    found, todo = [], [parser]
    while todo:
        p = todo.pop()
        found.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return found


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_runs_and_lists_every_flag(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvpush {name}")
    for parser in _parsers(name):
        text = parser.format_help()
        for action in parser._actions:
            assert action.help != argparse.SUPPRESS, f"{parser.prog}: {action.option_strings} hidden"
            for flag in action.option_strings:
                assert flag in text, f"{parser.prog}: {flag} not in --help"


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_a_usage_error_exits_2_with_the_commands_prefix(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--no-such-flag"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"kvpush {name}") and ": error: " in err[-1], err


def test_a_commands_own_usage_error_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--min-tokens", "10", "--max-tokens", "5"]) == 2
    assert (
        capsys.readouterr().err.strip() == "kvpush demo: error: --min-tokens must be >= 1 and <= --max-tokens"
    )


@pytest.mark.parametrize("name", ["demo", "soak", "fuzz", "doctor"])
def test_json_prints_and_output_writes(name: str) -> None:
    parser = cli.Parser(prog=f"kvpush {name}")
    importlib.import_module(cli.COMMANDS[name].module).configure(parser)
    args = parser.parse_args(["--json"])
    assert args.json is True and args.output is None
    assert parser.parse_args(["--output", "x.json"]).output == "x.json"


def test_emit_json_prints_on_stdout_and_writes_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sub" / "r.json"
    args = argparse.Namespace(json=True, output=str(out))
    with cliutil.text_to_stderr(args):
        print("a line of text")
        assert cliutil.emit_json(args, {"a": 1})
    got = capsys.readouterr()
    assert json.loads(got.out) == {"a": 1} and "a line of text" in got.err
    assert json.loads(out.read_text()) == {"a": 1}
    assert not cliutil.emit_json(argparse.Namespace(json=False, output=None), {"a": 1})


def test_fuzz_json_is_the_only_thing_on_stdout() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "fuzz", "--cases", "50", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cases"] == 50


def test_plot_title_comes_from_the_runs(tmp_path: Path) -> None:
    from kvpush.apps.bench import plot

    (tmp_path / "push_qps1_in100_out8_iter0.json").write_text(
        json.dumps({"model_id": "Tiny-1B (emulated)", "model_tp": 2, "mean_ttft_ms": 1.0})
    )
    assert plot.title(tmp_path) == "Tiny-1B (emulated), TP2"
    assert "Qwen" not in Path(plot.__file__).read_text()
