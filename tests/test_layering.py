"""The package's layers, read from its imports: each folder is one layer, imports point down.

primitives (and the hidden-state type) → compiler → algorithms → loops → drivers; the
public faces (``braintrace/__init__``, ``braintrace.primitives``, ``braintrace.tasks``,
``braintrace.layers``, ``__main__``) on top. A module never imports a higher layer, never
another package's private module (``braintrace._compiler._step`` from outside
``_compiler``: use the package's face, ``braintrace._compiler``), and the modules import
each other without a cycle.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS = {
    "braintrace._version": 0,
    "braintrace._arguments": 0,
    "braintrace._hidden": 0,
    "braintrace._platform": 0,
    "braintrace._primitives": 0,
    "braintrace._compiler": 1,
    "braintrace._algorithms": 2,
    "braintrace._loops": 3,
    "braintrace._drivers": 4,
    "braintrace.primitives": 5,
    "braintrace.tasks": 5,
    "braintrace.layers": 5,
    "braintrace._nir": 6,
    "braintrace.nir": 6,
    "braintrace": 7,
    "braintrace.__main__": 7,
}
"""Each unit and its layer (the longest matching prefix of a module's name decides)."""


def _module_name(path: pathlib.Path) -> str:
    if path.is_relative_to(ROOT / "layers"):
        parts = ("braintrace", "layers", *path.relative_to(ROOT / "layers").with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts)


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    nodes = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        nodes.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return nodes


def _imports(annotations: bool = False) -> dict[str, set[str]]:
    """Every braintrace module and the braintrace modules it imports (absolute or relative);
    with ``annotations``, also those imported under ``if TYPE_CHECKING:``."""
    found: dict[str, set[str]] = {}
    for path in sorted([*(ROOT / "braintrace").rglob("*.py"), *(ROOT / "layers").rglob("*.py")]):
        name = _module_name(path)
        package = _package(name, path)
        targets = found.setdefault(name, set())
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("braintrace"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                if module.startswith("braintrace"):
                    targets.add(module)
                    targets.update(f"{module}.{a.name}" for a in node.names)
    return found


def _unit(name: str) -> str:
    return max((u for u in LAYERS if name == u or name.startswith(u + ".")), key=len)


def _existing(name: str, modules: dict[str, set[str]]) -> str | None:
    """``name`` if it is a module of the package, else its parent if that is (``from x import
    y`` where ``y`` is a name in ``x``)."""
    if name in modules:
        return name
    parent = name.rpartition(".")[0]
    return parent if parent in modules else None


def test_no_module_imports_a_higher_layer():
    modules = _imports()
    wrong = []
    for name, targets in modules.items():
        for target in filter(None, (_existing(t, modules) for t in targets)):
            if LAYERS[_unit(target)] > LAYERS[_unit(name)]:
                wrong.append(f"{name} ({_unit(name)}) imports {target} ({_unit(target)})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _private_owner(target: str) -> str | None:
    """The package a private module belongs to (``braintrace._compiler`` for
    ``braintrace._compiler._step``), or ``None`` if ``target`` is not private to a package."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_module_imports_another_packages_private_module():
    modules = _imports()
    wrong = []
    for name, targets in modules.items():
        for target in filter(None, (_existing(t, modules) for t in targets)):
            owner = _private_owner(target)
            if owner is not None and not (name == owner or name.startswith(owner + ".")):
                wrong.append(f"{name} imports {target}, private to {owner}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _cycle(modules: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among ``modules`` (the modules on it, in order), or ``None``."""
    graph = {name: {m for m in (_existing(t, modules) for t in targets) if m and m != name}
             for name, targets in modules.items()}
    # a package's __init__ re-exporting its own modules is not a cycle of concepts
    graph = {name: {t for t in deps if not name.startswith(t + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], node, nxt]
            if nxt not in state:
                found = visit(nxt, [*stack, node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_modules_import_each_other_without_a_cycle():
    cycle = _cycle(_imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cycle_even_through_imports_for_annotations():
    """An import under ``if TYPE_CHECKING:`` that closes a cycle is still two modules that
    need each other: the records both use belong in a module below them."""
    cycle = _cycle(_imports(annotations=True))
    assert cycle is None, "import cycle (annotations included): " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle():
    """A negative control: a cycle through an annotation-only import is found."""
    modules = {"braintrace._algorithms._a": {"braintrace._algorithms._b"},
               "braintrace._algorithms._b": {"braintrace._algorithms._a"}}
    assert _cycle(modules) == ["braintrace._algorithms._a", "braintrace._algorithms._b",
                               "braintrace._algorithms._a"]


def _private_names() -> list[str]:
    """``'module imports _name from other'`` for every private name (not a module) that a
    module imports from another module."""
    found = []
    paths = sorted([*(ROOT / "braintrace").rglob("*.py"), *(ROOT / "layers").rglob("*.py")])
    modules = {_module_name(path) for path in paths}
    for path in paths:
        name = _module_name(path)
        package = _package(name, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{source}.{alias.name}" not in modules:
                    found.append(f"{name} imports {alias.name} from {source}")
    return found


def test_no_module_imports_another_modules_private_name():
    """A private helper shared by two modules belongs in a module of its own, public to its
    package (``layers/_initializers.py``), not borrowed from one of them."""
    wrong = _private_names()
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_private_cross_package_import():
    """A negative control: the private-module rule flags what it should."""
    assert _private_owner("braintrace._compiler._step") == "braintrace._compiler"
    assert _private_owner("braintrace._compiler") == "braintrace"
    assert _private_owner("braintrace.layers") is None
    assert _unit("braintrace._loops._blocked") == "braintrace._loops"
