"""The product packages' modules import one another without a cycle, and each package only
the ones below it: router -> actors -> transfer -> pd_cluster -> kernels.

A cycle hidden by a function-level import still couples the two modules both ways (neither
can be read, tested or moved without the other), so every import counts here: at module
level, inside functions, and under `if TYPE_CHECKING`. The graph is read from the source
with `ast`, importing nothing.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pd_cluster", "actors", "transfer", "router", "kernels")
LAYERS = ("kernels", "pd_cluster", "transfer", "actors", "router")   # each above the ones before


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    """Every product module's dotted name -> its file."""
    return {module_name(path): path
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` (module `module`) imports anywhere in its source.
    `import a.b` names a.b; `from a.b import c` names a.b.c if that is a module, else a.b.
    A relative import is resolved against the module's package first."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # `.` is the module's package, each further dot one level up
                anchor = package.split(".")[:package.count(".") + 2 - node.level]
                base = ".".join([*anchor, base] if base else anchor)
            names += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                      for alias in node.names]
    return {name for name in names if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    """Each product module -> the product modules it imports."""
    modules = product_modules()
    return {module: imports_of(path, module, set(modules)) for module, path in modules.items()}


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import one another, directly or not: the graph's strongly
    connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:        # node roots a component: pop it off the stack
            component = set()
            while (member := stack.pop()) != node:
                component.add(member)
            components.append(component | {node})

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [component for component in components if len(component) > 1]


def shortest_cycle(graph: dict[str, set[str]], tangle: set[str]) -> list[str]:
    """A shortest cycle [m0, ..., m0] through the tangle's first module (breadth first)."""
    start = min(tangle)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & tangle):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"{sorted(tangle)} is not strongly connected")


def describe(graph: dict[str, set[str]], tangle: set[str]) -> str:
    edges = [f"  {m} -> {t}" for m in sorted(tangle) for t in sorted(graph[m] & tangle)]
    return "\n".join([" -> ".join(shortest_cycle(graph, tangle)) + ", among:", *edges])


def test_graph_counts_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The parser's own check: imports inside functions and relative ones count, and
    `from a import b` names a.b when that is a module, else a."""
    (tmp_path / "pkg").mkdir()
    path = tmp_path / "pkg" / "mod.py"
    path.write_text("from . import sibling\n"
                    "from .sub import leaf, NAME\n"
                    "def f():\n"
                    "    import pkg.other\n")
    modules = {"pkg", "pkg.mod", "pkg.sibling", "pkg.sub", "pkg.sub.leaf", "pkg.other"}
    assert module_name(path, tmp_path) == "pkg.mod"
    assert imports_of(path, "pkg.mod", modules) == {"pkg.sibling", "pkg.sub.leaf", "pkg.sub",
                                                     "pkg.other"}


def test_tangles_and_their_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    found = sorted(tangles(graph), key=min)
    assert found == [{"a", "b", "c"}, {"d", "e"}]
    assert [shortest_cycle(graph, t) for t in found] == [["a", "b", "a"], ["d", "e", "d"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 100, "the product modules were not found"
    found = tangles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, t) for t in found)


def test_each_package_imports_only_the_packages_below_it() -> None:
    """The engine core (pd_cluster, no Ray) and the kernels stay usable without the serving
    packages above them."""
    layer = {package: i for i, package in enumerate(LAYERS)}
    upward = sorted(f"  {m} -> {t}" for m, targets in import_graph().items() for t in targets
                    if layer[t.split(".")[0]] > layer[m.split(".")[0]])
    assert not upward, "imports of a package above:\n" + "\n".join(upward)
