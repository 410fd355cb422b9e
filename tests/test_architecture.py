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


# ---- classes measured with their in-tree bases ----------------------------------------------------------

CLASS_FAMILY_LIMIT = 400
# Bases whose annotated class-body names are fields, not borrowed attributes.
_FIELD_BASES = {
    "Struct",
    "Protocol",
    "NamedTuple",
    "TypedDict",
    "Enum",
    "IntEnum",
    "StrEnum",
    "Flag",
    "Exception",
}


class _Class:
    def __init__(self, module: str, node: ast.ClassDef, imports: dict[str, str]) -> None:
        self.module, self.node, self.imports = module, node, imports
        self.name = f"{module}.{node.name}"
        self.lines = (node.end_lineno or node.lineno) - node.lineno + 1

    def base_names(self) -> list[str]:
        """Each base as a dotted name resolved through the module's imports (Generic[X] -> Generic)."""
        out = []
        for base in self.node.bases:
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name):
                out.append(self.imports.get(base.id, f"{self.module}.{base.id}"))
            elif isinstance(base, ast.Attribute):
                out.append(ast.unparse(base))
        return out

    def is_record(self) -> bool:
        """A dataclass, Struct, Protocol, enum or exception: its annotated names are its own fields."""
        for dec in self.node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if ast.unparse(target).split(".")[-1] == "dataclass":
                return True
        return any(b.split(".")[-1] in _FIELD_BASES or b.endswith("Error") for b in self.base_names())


def _classes() -> dict[str, _Class]:
    """Every class of the installed tree by its dotted name (module imports resolved, relative too)."""
    out: dict[str, _Class] = {}
    for module, path in _tree_modules().items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        imports: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for a in node.names:
                    imports[a.asname or a.name] = f"{src}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                c = _Class(module, node, imports)
                out[c.name] = c
    return out


def _resolve(name: str, classes: dict[str, _Class]) -> _Class | None:
    """The tree's class a dotted name points at, through re-exports (`from .x import C` in a package)."""
    seen = 0
    while name not in classes and seen < 8:
        module, _, attr = name.rpartition(".")
        mods = _tree_modules()
        if module not in mods:
            return None
        path = mods[module]
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        target = None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == attr for a in node.names):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                real = next(a.name for a in node.names if (a.asname or a.name) == attr)
                target = f"{src}.{real}"
        if target is None:
            return None
        name, seen = target, seen + 1
    return classes.get(name)


def _family(c: _Class, classes: dict[str, _Class]) -> list[_Class]:
    """The class and every base it inherits from inside the tree."""
    out, todo = [], [c]
    while todo:
        k = todo.pop()
        if k in out:
            continue
        out.append(k)
        todo += [b for n in k.base_names() if (b := _resolve(n, classes)) is not None]
    return out


def class_families_over(limit: int) -> dict[str, int]:
    classes = _classes()
    sizes = {name: sum(k.lines for k in _family(c, classes)) for name, c in classes.items()}
    return {name: n for name, n in sizes.items() if n > limit}


def borrowed_attributes() -> dict[str, list[str]]:
    """Classes that annotate, in their body, names they never assign themselves: attributes a host owns
    (the mixin pattern). Records (dataclasses, Structs, Protocols, enums, exceptions) declare fields."""
    classes = _classes()
    out: dict[str, list[str]] = {}
    for name, c in classes.items():
        family = _family(c, classes)
        if any(k.is_record() for k in family):
            continue
        if any(
            _resolve(b, classes) is None and b.split(".")[-1] not in ("Generic", "ABC", "object")
            for k in family
            for b in k.base_names()
        ):
            continue  # a subclass of a library class may narrow the types of attributes that class sets
        declared = [
            s.target.id
            for s in c.node.body
            if isinstance(s, ast.AnnAssign) and s.value is None and isinstance(s.target, ast.Name)
        ]
        assigned = {
            t.attr
            for k in family
            for n in ast.walk(k.node)
            for t in (n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)])
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)  # self.x, or cache.x in a factory
        }
        borrowed = [d for d in declared if d not in assigned and not d.isupper()]
        if borrowed:
            out[name] = borrowed
    return out


def stand_in_methods() -> list[str]:
    """Methods whose whole body is `raise NotImplementedError` in a class that is not abstract by
    declaration (abc): a sibling's method stood in for."""
    out = []
    for name, c in _classes().items():
        if any(b.split(".")[-1] in ("ABC", "Protocol") for b in c.base_names()):
            continue
        for f in c.node.body:
            if not isinstance(f, ast.FunctionDef):
                continue
            body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if (
                len(body) == 1
                and isinstance(body[0], ast.Raise)
                and "NotImplementedError" in ast.unparse(body[0])
                and not any("abstractmethod" in ast.unparse(d) for d in f.decorator_list)
            ):
                out.append(f"{name}.{f.name}")
    return out


def test_the_family_measure_counts_in_tree_bases_through_relative_imports_and_generics():
    classes = _classes()
    family = {k.name for k in _family(classes["kvpush.endpoint.decode.DecodeEndpoint"], classes)}
    assert "kvpush.endpoint.base.Endpoint" in family  # through Generic[...] and a relative import
    family = {k.name for k in _family(classes["kvpush.endpoint.base.EndpointRole"], classes)}
    assert "kvpush.endpoint.loop.LoopRole" in family  # a relative import from a sibling module
    family = {k.name for k in _family(classes["kvpush.protocol.handshake.AuthMismatch"], classes)}
    assert "kvpush.errors.KVPushError" in family  # bases of bases, across modules


def test_no_class_family_passes_400_lines():
    """A class is as big as what it inherits from inside the tree: splitting one over files by inheritance
    does not make it smaller (the sender machine was 703 lines over 4 files that way)."""
    big = class_families_over(CLASS_FAMILY_LIMIT)
    assert not big, f"classes over {CLASS_FAMILY_LIMIT} lines with their in-tree bases: {big}"


def test_no_class_annotates_attributes_it_does_not_own():
    assert not borrowed_attributes(), f"classes declaring attributes a host owns: {borrowed_attributes()}"


def test_no_method_stands_in_for_a_siblings():
    assert not stand_in_methods(), (
        f"NotImplementedError stand-ins outside abstract classes: {stand_in_methods()}"
    )


def test_at_most_twelve_functions_in_the_library_pass_complexity_12():
    """ruff's C901 (max-complexity 12, pyproject.toml) holds kvpush/ and backends/; the functions still
    over it carry `noqa: C901`, and there may be no more of them than there were when the rule came in
    (12, all programs in kvpush/apps: 18 in kvpush/ before step 3, 5 of them in the sender machine)."""
    marked = [
        f"{p.relative_to(ROOT)}:{i}"
        for top in ("kvpush", "backends")
        for p in sorted((ROOT / top).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "noqa: C901" in line
    ]
    assert len(marked) <= 12, f"functions exempt from the complexity limit: {marked}"
    assert all(m.startswith("kvpush/apps/") for m in marked), marked
