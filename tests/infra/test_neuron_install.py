"""scripts/neuron_install.sh never replaces a Neuron DLAMI venv's NIXL or torch.

The "DLAMI venv" here is a stand-in: a fresh virtualenv holding fake dist-infos of nixl 1.3.2 and torch
2.11.0 (what the DLAMI 2.32 vLLM venv ships, neuron.md 2.1), and the "index" is a local folder of fake
wheels: nixl 1.5.1 (which kvpush's pyproject pins) requiring torch 2.13.0, torch 2.13.0 itself, and one
for each other requirement of kvpush[bench] at the version this repository's .venv has (read from the
real pyproject.toml). pip resolves against them offline (--no-index) with --dry-run --report, first the
naive `pip install kvpush[bench]` (which must want the newer nixl and torch: proof the check can fail),
then the script's recipe (which must not).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet

from tests.infra.infra_tools import ROOT, infra_tool, run

tomllib = pytest.importorskip(
    "tomllib", reason="Python >= 3.11 reads pyproject.toml here, as the script does"
)

SCRIPT = ROOT / "scripts" / "neuron_install.sh"
PROTECTED = ROOT / "scripts" / "neuron-protected.txt"
DLAMI = {"nixl": "1.3.2", "torch": "2.11.0"}  # what the stand-in DLAMI venv holds
NIXL_RELEASE = "1.5.1"  # the NIXL the stand-in index offers (inside kvpush's range)
# the version and NIXL pin of this checkout's pyproject (the stand-in wheel and the messages use them)
_PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
KVPUSH_VERSION = _PYPROJECT["version"]
NIXL_PIN = _PYPROJECT["optional-dependencies"]["nixl"][0]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, req
    return _norm(m.group(1))


def _protected() -> set[str]:
    lines = (ln.split("#")[0].strip() for ln in PROTECTED.read_text().splitlines())
    return {_norm(ln) for ln in lines if ln}


def _metadata(name: str, ver: str, requires: list[str]) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {ver}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    return "\n".join(lines) + "\n"


def _fake_wheel(folder: Path, name: str, ver: str, requires: list[str] = ()) -> Path:  # type: ignore[assignment]
    stem = f"{re.sub(r'[-.]+', '_', name)}-{ver}"
    path = folder / f"{stem}-py3-none-any.whl"
    info = f"{stem}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", _metadata(name, ver, list(requires)))
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: kvpush-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return path


def _kvpush_requirements(extras: tuple[str, ...]) -> list[str]:
    """kvpush's requirements with these extras, its own extras (`kvpush[nixl]`) expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    todo, seen = list(extras), set(extras)
    while todo:
        for req in project["optional-dependencies"][todo.pop(0)]:
            own = re.fullmatch(r"\s*kvpush\[([^\]]*)\]\s*", req)
            if own is None:
                reqs.append(req)
                continue
            subs = [e.strip() for e in own.group(1).split(",") if e.strip() not in seen]
            seen.update(subs)
            todo += subs
    return list(dict.fromkeys(reqs))


@pytest.fixture(scope="module")
def dlami(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dlami")
    venv = root / "venv"
    proc = run([sys._base_executable, "-m", "venv", str(venv)], timeout=120)  # type: ignore[attr-defined]
    assert proc.returncode == 0, proc.stderr
    site = next((venv / "lib").glob("python3*/site-packages"))
    for name, ver in DLAMI.items():  # fake dist-infos: what pip sees as installed
        info = site / f"{name}-{ver}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(_metadata(name, ver, []))
        (info / "INSTALLER").write_text("dlami-standin\n")
        (info / "RECORD").write_text("")
    wheels = root / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "torch", "2.13.0")
    kvpush_reqs = _kvpush_requirements(("bench",))
    for req in kvpush_reqs:
        name = _req_name(req)
        if name == "nixl":
            assert SpecifierSet(req[len("nixl") :]).contains(NIXL_RELEASE), req
            _fake_wheel(wheels, "nixl", NIXL_RELEASE, ["torch==2.13.0"])
        else:
            _fake_wheel(wheels, name, version(name))  # the version this repo's .venv runs
    kvpush = _fake_wheel(wheels, "kvpush", KVPUSH_VERSION, kvpush_reqs)  # stand-in for the built kvpush wheel
    return {"venv": venv, "wheels": wheels, "kvpush": kvpush, "root": root}


def _env(dlami: dict[str, Path], **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(dlami["root"]),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(dlami["wheels"]),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        **extra,
    }


def _would_install(report: Path) -> dict[str, str]:
    data: dict[str, Any] = json.loads(report.read_text())
    return {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}


def test_script_passes_shellcheck() -> None:
    proc = run([infra_tool("shellcheck"), "-s", "bash", "-S", "warning", str(SCRIPT)])
    assert proc.returncode == 0, proc.stdout


def test_protected_list_covers_nixl_torch_and_what_kvpush_requires_from_them() -> None:
    names = _protected()
    assert {
        "nixl",
        "nixl-cu12",
        "nixl-cu13",
        "torch",
        "vllm",
        "vllm-neuron",
        "libtorch-neuronx-lite",
    } <= names
    # every kvpush requirement that could bring NIXL or torch is protected
    assert {_req_name(r) for r in _kvpush_requirements(("bench",))} & {"nixl", "torch"} <= names


def test_naive_install_would_replace_the_dlami_nixl_and_torch(dlami: dict[str, Path]) -> None:
    """The control: without the recipe pip upgrades both (so the next test can fail)."""
    report = dlami["root"] / "naive.json"
    proc = subprocess.run(
        [str(dlami["venv"] / "bin/python"), "-m", "pip", "install", "-q", "--dry-run", "--report", str(report),
         f"{dlami['kvpush']}[bench]"],
        env=_env(dlami), capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = _would_install(report)
    assert got.get("nixl") == "1.5.1" and got.get("torch") == "2.13.0", got


def test_recipe_installs_kvpush_and_its_deps_but_never_nixl_or_torch(dlami: dict[str, Path]) -> None:
    reports = dlami["root"] / "reports"
    reports.mkdir()
    proc = subprocess.run(
        [str(SCRIPT), str(dlami["venv"]), str(ROOT), "bench"],
        env=_env(dlami, DRY_RUN="1", REPORT_DIR=str(reports), KVPUSH_DIST=str(dlami["kvpush"]),
                 CONSTRAINTS=str(dlami["root"] / "constraints.txt")),
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"keeping the venv's nixl 1.3.2 (kvpush asks for {NIXL_PIN})" in proc.stdout
    deps, kvpush = _would_install(reports / "deps.json"), _would_install(reports / "kvpush.json")
    protected = _protected()
    assert kvpush == {"kvpush": KVPUSH_VERSION}
    assert not set(deps) & protected, deps
    expected = {_req_name(r) for r in _kvpush_requirements(("bench",))} - {"nixl"}
    assert set(deps) == expected, deps  # everything else kvpush needs is installed
    constraints = (dlami["root"] / "constraints.txt").read_text()
    assert "nixl==1.3.2\n" in constraints and "torch==2.11.0\n" in constraints


def test_recipe_refuses_a_venv_without_nixl(dlami: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "bare"
    assert run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0  # type: ignore[attr-defined]
    proc = subprocess.run(
        [str(SCRIPT), str(venv), str(ROOT), "bench"],
        env=_env(dlami, DRY_RUN="1", CONSTRAINTS=str(tmp_path / "c.txt")),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"kvpush needs {NIXL_PIN} and the venv has none" in proc.stderr
