"""The layering of docs/design.md, checked on the source: no import cycle anywhere in
distorefs/, and each layer imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "distorefs"

# layer -> modules it may not import (by dotted prefix)
FORBIDDEN = {
    "distorefs.tiers": ("distorefs.stores", "distorefs.fs", "distorefs.peers", "distorefs.daemon", "pyfuse3"),
    "distorefs.stores": ("distorefs.fs", "distorefs.peers", "distorefs.daemon", "pyfuse3"),
    "distorefs.cluster": ("distorefs.tiers", "distorefs.stores", "distorefs.fs", "distorefs.peers", "pyfuse3"),
    "distorefs.peers": ("distorefs.fs", "distorefs.daemon", "pyfuse3"),
    "distorefs.fs": ("distorefs.peers", "distorefs.daemon"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the modules it imports, anywhere in it (also under TYPE_CHECKING: an
    import there is a cycle all the same for a reader and for mypy)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        tree = ast.parse(path.read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = found
    return {
        name: {dep for dep in deps if dep in graph or not dep.startswith("distorefs")} for name, deps in graph.items()
    }


def test_each_layer_imports_only_the_layers_below_it() -> None:
    offences = [
        f"{module} imports {dep}"
        for module, deps in imports().items()
        for layer, banned in FORBIDDEN.items()
        if module == layer or module.startswith(layer + ".")
        for dep in deps
        if any(dep == b or dep.startswith(b + ".") for b in banned)
    ]
    assert offences == []


def test_no_import_cycle_in_the_package() -> None:
    graph = {name: {d for d in deps if d.startswith("distorefs")} for name, deps in imports().items()}
    # a package's __init__ importing its own modules is not a cycle through the package
    edges = {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []
