"""Imports in `mars_jax` run one way (WORKSPACE.md): no two modules import each other,
directly or through others, and no two rooms do, a room being a subpackage (`mars_jax.rl`, ...)
or a top-level module (`mars_jax.errors`, ...). Every import counts, a function's included. The
graph is read from the source with `ast`; nothing is imported."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mars_jax"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              modules: dict[str, pathlib.Path]) -> list[str]:
    """The modules `node` names: each `import a.b`'s a.b; for `from m import x`, m.x where it is
    a module, else m."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parts = module.split(".")
        base = parts[:len(parts) - node.level + is_package]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
            for alias in node.names]


def import_graph() -> Graph:
    modules = _modules()
    graph: Graph = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, path.name == "__init__.py", modules):
                    if name in modules and name != module:
                        edges[name] = min(edges.get(name, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def room(module: str) -> str:
    """A subpackage's name, or a top-level module's own."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return module


def room_graph(graph: Graph) -> dict[str, dict[str, str]]:
    """room -> {room it imports: one import making that arrow, 'a -> b'}."""
    rooms: dict[str, dict[str, str]] = {}
    for a, edges in graph.items():
        rooms.setdefault(room(a), {})
        for b in edges:
            if room(a) != room(b):
                rooms[room(a)].setdefault(room(b), f"{a}:{edges[b]} -> {b}")
    return rooms


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _arrows(graph, component: list[str]) -> list[str]:
    return [f"{a} -> {b} ({graph[a][b]})" for a in component for b in graph[a] if b in component]


def test_the_graph_sees_every_kind_of_import():
    """The reader finds a function-level import (mars_jax.config_validation imports
    mars_jax.data.builder inside `_data`), a `from package import module` and a package's
    `__init__` importing its modules; a room is a subpackage or a top-level module."""
    graph = import_graph()
    assert "mars_jax.data.builder" in graph["mars_jax.config_validation"]
    assert "mars_jax.sharding" in graph["mars_jax.layers.attention"]
    assert "mars_jax.sampling.engine" in graph["mars_jax.sampling"]
    assert [room(m) for m in ("mars_jax.rl.trainer", "mars_jax.sampling", "mars_jax.errors")] \
        == ["mars_jax.rl", "mars_jax.sampling", "mars_jax.errors"]


def test_no_module_cycle():
    graph = import_graph()
    assert not cycles(graph), "\n".join(
        "modules that import each other: " + "; ".join(_arrows(graph, c)) for c in cycles(graph))


def test_no_room_cycle():
    rooms = room_graph(import_graph())
    found = cycles(rooms)
    assert not found, "\n".join(
        "rooms that import each other: " + "; ".join(_arrows(rooms, c)) for c in found)


def test_cycle_finder_on_a_hand_made_graph():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"f": 1},
             "f": {"e": 1}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e", "f"]]
