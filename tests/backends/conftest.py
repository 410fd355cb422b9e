"""The libnrt stand-in (tests/backends/standin/libnrt_standin.c, written for kvpush: NOT the Neuron
runtime), compiled with gcc at test time. Each test gets its own copy of the library file, so the
stand-in's global state (initialised, HBM mapping) starts fresh."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpush.backends.neuron import NeuronRuntime

SOURCE = Path(__file__).parent / "standin" / "libnrt_standin.c"
OLD_RUNTIME = (
    "-DSTANDIN_NO_EFA_BDF",
    "-DSTANDIN_NO_MEMORY_STATS",
    "-DSTANDIN_RT_MAJOR=2",
    "-DSTANDIN_RT_MINOR=30",
    "-DSTANDIN_RT_PATCH=0",
)


@pytest.fixture(scope="session")
def standin_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler for the libnrt stand-in")
    out = tmp_path_factory.mktemp("nrt-standin")
    builds = {}
    for name, flags in (("current", ()), ("old", OLD_RUNTIME)):
        so = out / f"libnrt_standin_{name}.so"
        subprocess.run(
            [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-pthread", *flags, "-o", str(so), str(SOURCE)],
            check=True,
        )
        builds[name] = so
    return builds


@pytest.fixture
def load_standin(standin_builds: dict[str, Path], tmp_path: Path) -> Callable[..., NeuronRuntime]:
    def load(kind: str = "current") -> NeuronRuntime:
        copy = tmp_path / f"libnrt-{kind}-{uuid.uuid4().hex[:8]}.so"
        shutil.copy(standin_builds[kind], copy)
        return NeuronRuntime.load(str(copy))

    return load
