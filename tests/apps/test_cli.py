"""The `kvpush` command line as a user meets it: --version, defaults in every --help, one-line errors
(bad values, busy ports, missing optional dependencies, kvpush errors) and the old flag names still
accepted after the renames that follow `vllm bench serve`."""

from __future__ import annotations

import argparse
import importlib
import socket
import sys
import types
from pathlib import Path

import pytest

import kvpush
from kvpush import cli
from kvpush.apps.install_hint import install_command
from kvpush.errors import ConfigError
from kvpush.protocol.wire import WIRE_VERSION


def _parsers(name: str) -> list[argparse.ArgumentParser]:
    """The command's parser as `kvpush NAME` builds it, and any sub-parsers (e.g. `cluster list`)."""
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


def _one_line_error(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"{prog}: error: "), err
    assert not any("Traceback" in line for line in err), err
    return err[-1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvpush {kvpush.__version__} ") and f"wire protocol v{WIRE_VERSION}" in out


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_help_shows_every_default(name: str) -> None:
    for parser in _parsers(name):
        text = parser.format_help()
        for action in parser._actions:
            if (
                not action.option_strings
                or action.nargs == 0
                or action.help == argparse.SUPPRESS
                or action.default is argparse.SUPPRESS
            ):
                continue
            # the option's help entry runs from its flag to the next entry
            flag = action.option_strings[-1]
            entry = text[text.index(f"  {action.option_strings[0]}") :].split("\n  -", 1)[0]
            assert "default" in entry.lower(), f"kvpush {name} {flag}: no default in --help:\n{entry}"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["fuzz", "--cases", "-5"], "--cases: -5 is not a positive integer"),
        (["fuzz", "--cases", "0"], "--cases: 0 is not a positive integer"),
        (
            ["proxy", "--prefill", "http://a", "--decode", "http://b", "--log-level", "LOUD"],
            "'LOUD' is not a log level",
        ),
        (["demo", "--port", "70000"], "70000 is not a TCP port"),
        (["demo", "--num-prompts", "-1"], "-1 is not a positive integer"),
        (["bench", "--random-output-len", "x"], "'x' is not an integer"),
    ],
)
def test_bad_values_are_refused_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert needle in _one_line_error(capsys, f"kvpush {argv[0]}")


def test_a_busy_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("aiohttp")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [
            "proxy",
            "--mode",
            "pull",
            "--prefill",
            "http://127.0.0.1:9",
            "--decode",
            "http://127.0.0.1:9",
        ]
        assert cli.main([*argv, "--port", str(port)]) == 2
    line = _one_line_error(capsys, "kvpush proxy")
    assert "already in use" in line and "--port" in line


def test_a_missing_extra_is_named_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = cli._find_spec
    monkeypatch.setattr(cli, "_find_spec", lambda name: None if name == "matplotlib" else real(name))
    assert cli.main(["plot", "--result-dir", "/nonexistent"]) == 2
    assert install_command("plot") in _one_line_error(capsys, "kvpush plot")
    monkeypatch.setattr(cli, "_find_spec", lambda name: None if name == "nixl" else real(name))
    assert cli.main(["demo"]) == 2
    assert install_command("nixl") in _one_line_error(capsys, "kvpush demo")


def test_help_works_without_the_optional_dependencies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["proxy", "--help"])
    assert exit_.value.code == 0 and "--log-level" in capsys.readouterr().out


def _fake_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, body: str) -> None:
    (tmp_path / "kvpush_fake_cmd.py").write_text(
        "import argparse\n\ndef configure(parser):\n    pass\n\ndef run(args):\n" + body
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kvpush_fake_cmd", None)
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("kvpush_fake_cmd", "a test command"))


def test_a_module_missing_at_run_time_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_command(monkeypatch, tmp_path, "    raise ModuleNotFoundError('no aiohttp', name='aiohttp')\n")
    assert cli.main(["fake"]) == 2
    assert install_command("proxy") in _one_line_error(capsys, "kvpush fake")


def test_a_kvpush_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_command(
        monkeypatch,
        tmp_path,
        "    from kvpush.errors import ConfigError\n    raise ConfigError('port must be set')\n",
    )
    assert cli.main(["fake"]) == 2
    assert _one_line_error(capsys, "kvpush fake").endswith("port must be set")
    assert issubclass(ConfigError, Exception)


def test_other_errors_still_raise(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bug is not hidden behind a one-liner: only the known user errors are shortened."""
    _fake_command(monkeypatch, tmp_path, "    raise ZeroDivisionError('bug')\n")
    with pytest.raises(ZeroDivisionError):
        cli.main(["fake"])


@pytest.mark.parametrize(
    ("name", "old", "new", "dest", "value"),
    [
        ("bench", "--qps", "--request-rate", "qps", "1,2"),
        ("bench", "--input-lens", "--random-input-len", "input_lens", "100"),
        ("bench", "--output-len", "--random-output-len", "output_len", "7"),
        ("bench", "--num-requests", "--num-prompts", "num_requests", "5"),
        ("bench", "--warmup", "--num-warmups", "warmup", "2"),
        ("bench", "--out", "--result-dir", "out", "r"),
        ("plot", "--results-dir", "--result-dir", "results_dir", "r"),
        ("bench-vllm", "--qps", "--request-rate", "qps", "1,2"),
        ("bench-vllm", "--input-lens", "--random-input-len", "input_lens", "100"),
        ("bench-vllm", "--output-len", "--random-output-len", "output_len", "7"),
        ("demo", "--requests", "--num-prompts", "requests", "5"),
        ("demo", "--output-json", "--output", "output", "x.json"),
        ("fuzz", "--output-json", "--output", "output", "x.json"),
    ],
)
def test_renamed_flags_keep_their_old_names_listed_in_help(
    name: str, old: str, new: str, dest: str, value: str
) -> None:
    """Old names still work, and --help lists them (the docs show some), as old names of the new flag."""
    [parser] = _parsers(name)
    assert getattr(parser.parse_args([old, value]), dest) == getattr(parser.parse_args([new, value]), dest)
    assert getattr(parser.parse_args([]), dest) != value or value == "r"
    usage = parser.format_help()
    assert new in usage and old in usage
    assert f"old name of {new}" in usage or f"{new} PATH, {old}" in usage or f"{old} PATH, {new}" in usage


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["nonsense"])
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_commands_are_modules_with_configure_and_run() -> None:
    for command in cli.COMMANDS.values():
        module = importlib.import_module(command.module)
        assert isinstance(module, types.ModuleType)
        assert callable(module.configure) and callable(module.run)
