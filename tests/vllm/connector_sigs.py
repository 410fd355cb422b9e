"""Method signatures of vLLM's connector base classes (read with ast from a base.py's source) and of
KVPushConnector (read with inspect), and what differs between them; shared by test_connector_api.py and
test_connector_contract.py."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

BASE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASSES = ("KVConnectorBase_V1", "SupportsHMA")


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
