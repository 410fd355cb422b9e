"""The tree's shape, checked: the protocol core is pure, imports only point down the layers, and the
integrations' internal imports are relative (so a reader can follow them without installing)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# lower layers first; a module may import its own layer or any layer below it, never one above
LAYERS = ["errors", "protocol", "config", "transport", "endpoint", "apps"]


def _imports(path: Path, package: str) -> list[str]:
    """Absolute module names `path` imports (relative imports resolved against `package`)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names]  # `from . import x` names modules too
    return out


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    mod = _module_of(path)
    return mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kvpush" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def test_protocol_imports_nothing_outside_protocol_and_errors_statically():
    allowed_third_party = {
        "__future__",
        "collections",
        "dataclasses",
        "enum",
        "hashlib",
        "heapq",
        "hmac",
        "typing",
        "msgspec",
        "numpy",
        "itertools",
        "functools",
        "math",
        "re",
        "types",
    }
    for path in sorted((ROOT / "kvpush" / "protocol").glob("*.py")):
        for mod in _imports(path, "kvpush.protocol"):
            top = mod.split(".")[0]
            if top == "kvpush":
                assert mod.startswith(("kvpush.protocol", "kvpush.errors")), f"{path.name} imports {mod}"
            else:
                assert top in allowed_third_party, f"{path.name} imports {mod}: protocol/ must stay sans-IO"


def test_protocol_imports_nothing_outside_protocol_and_errors_at_runtime():
    code = (
        "import sys\n"
        "import kvpush.protocol.wire, kvpush.protocol.layout, kvpush.protocol.plan, kvpush.protocol.tp\n"
        "import kvpush.protocol.handshake, kvpush.protocol.sender, kvpush.protocol.receiver\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    mods = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    ours = {m for m in mods if m.startswith("kvpush")}
    assert all(m == "kvpush" or m.startswith(("kvpush.protocol", "kvpush.errors")) for m in ours), ours
    for io in ("zmq", "nixl", "torch", "vllm", "socket", "threading", "prometheus_client"):
        assert io not in mods, f"importing the protocol pulled in {io}"


def test_the_import_graph_of_kvpush_has_no_upward_arrows():
    for path in sorted((ROOT / "kvpush").rglob("*.py")):
        here = _layer(_module_of(path))
        if here is None:
            continue  # kvpush/__init__.py (the public surface) and cli.py sit above every layer
        for mod in _imports(path, _package_of(path)):
            there = _layer(mod)
            if there is None:
                assert not mod.startswith(("kvpush.platforms", "kvpush.backends")) or here == "apps", (
                    f"{path.relative_to(ROOT)} imports {mod}: only apps may use backends or platforms"
                )
                continue
            assert LAYERS.index(there) <= LAYERS.index(here), (
                f"{path.relative_to(ROOT)} ({here}) imports {mod} ({there})"
            )


def test_backends_and_platforms_import_their_own_modules_relatively():
    for top, pkg in (("backends", "kvpush.backends"), ("platforms", "kvpush.platforms")):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    assert not name.startswith(pkg), (
                        f"{path.relative_to(ROOT)} imports {name}: use a relative import inside {top}/"
                    )


# the folders as pyproject's package-dir installs them
_PACKAGE_ROOTS = {"kvpush": "kvpush", "backends": "kvpush.backends", "platforms": "kvpush.platforms"}


def _tree_modules() -> dict[str, Path]:
    """Every module of the installed tree by its installed name (backends/x.py is kvpush.backends.x)."""
    out: dict[str, Path] = {}
    for folder, package in _PACKAGE_ROOTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (anywhere in its body: a cycle closed by a function-
    level import is still a cycle for a reader). An import of `a.b.c` names the nearest module of the tree
    (`a.b.c`, else `a.b`); `from pkg import x` names `pkg.x` when that is a module, else `pkg`."""
    modules = _tree_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for mod in _imports(path, package):
            while mod and mod not in modules:
                mod = mod.rpartition(".")[0]
            if mod and mod != name:
                targets.add(mod)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_function_level_imports_across_the_package_dir_mapping():
    graph = _import_graph()
    assert "kvpush.protocol.layout" in graph["kvpush.backends.base"]
    assert "kvpush.endpoint" in graph["kvpush.platforms.vllm.prefill_worker"]


def test_there_is_no_import_circle_anywhere_in_the_tree():
    cycles = _cycles(_import_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_in_kvpush_passes_500_lines():
    """A file that grows past 500 lines is split by what changes together before it takes more
    (the prefill endpoint reached 971 lines in one class before this rule was checked)."""
    big = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "kvpush").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not big, f"modules over 500 lines: {big}"
