"""CPU: the package's modules import one way (no cycle). Checked on the source with
`ast`: relative imports (`from .x import y`, `from . import x`) and absolute ones of
`indexer_q.*`, at module level and inside functions alike (an import inside a function
hides a cycle, it does not remove it: the two modules still depend on each other)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "indexer_q"


def _targets(node, package_modules) -> set:
    """The package's modules an import statement reaches."""
    found = set()
    if isinstance(node, ast.ImportFrom):
        if node.level == 1:
            if node.module:  # from .x import y / from .x.y import z
                found.add(node.module.split(".")[0])
            else:  # from . import x, y
                found |= {a.name for a in node.names}
        elif node.level == 0 and node.module and node.module.split(".")[0] == "indexer_q":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from indexer_q import x
                found |= {a.name for a in node.names}
    elif isinstance(node, ast.Import):
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "indexer_q" and len(parts) > 1:
                found.add(parts[1])
    return found & package_modules


def import_graph(src: Path = SRC) -> dict:
    """module -> sorted modules of the package it imports (anywhere in its source)."""
    paths = {p.stem: p for p in sorted(src.glob("*.py"))}
    names = set(paths)
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            deps |= _targets(node, names)
        deps.discard(name)
        graph[name] = sorted(deps)
    return graph


def find_cycle(graph: dict):
    """One cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in graph.get(u, ()):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state:
                cycle = visit(v)
                if cycle:
                    return cycle
        stack.pop()
        state[u] = "done"
        return None

    for u in sorted(graph):
        if u not in state:
            cycle = visit(u)
            if cycle:
                return cycle
    return None


def test_the_checker_finds_cycles():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None
    tree = ast.parse("def f():\n    from . import b\n    from .c.d import e\n    import indexer_q.f\n")
    found = set()
    for node in ast.walk(tree):
        found |= _targets(node, {"b", "c", "f", "g"})
    assert found == {"b", "c", "f"}


def test_src_imports_have_no_cycle():
    graph = import_graph()
    assert {"api", "op", "reference", "validate", "weights", "table"} <= set(graph)
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail("import cycle in src/indexer_q: " + " -> ".join(cycle), pytrace=False)
