"""The import graph of our packages has no cycles: a module's imports say what it builds on.

Imports are read statically (ast), every one of them -- module level, inside functions,
under `if TYPE_CHECKING:` -- because a function-level import that closes a cycle is the
same dependency, only deferred until it bites. (importlib.import_module of a user's
'module:attribute' in parity.implementation loads a plugin; it is no dependency of ours.)
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("mha_spec", "mha_torch", "mha_jax", "parity")

def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file of our packages (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, ours) -> set[str]:
    """The modules of ours one import statement loads (its target; `from X import m` with m a module: X.m)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in ours else source for alias in node.names]
    else:
        return set()
    out = set()
    for name in names:
        while name and name not in ours:  # `import parity.harness.runner` or a name of a module: its deepest module of ours
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


@functools.cache  # parsed once per session; callers only read it
def import_graph() -> dict[str, set[str]]:
    ours = _modules()
    graph = {}
    for module, path in ours.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set().union(*(_imported(n, module, is_package, ours) for n in ast.walk(tree))) - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan): each holds at least one cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _a_cycle(graph, component) -> list[str]:
    """One concrete cycle inside a component, for the failure message (a -> b -> ... -> a)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_no_import_cycles_among_our_modules():
    graph = import_graph()
    unexpected = list(cycles(graph))
    assert not unexpected, "import cycles: " + "; ".join(" -> ".join(_a_cycle(graph, c)) for c in unexpected)


def test_the_cycle_finder_finds_cycles():
    """The detector itself: a planted 3-cycle and a 2-cycle are found, an acyclic chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert sorted(map(sorted, cycles(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert _a_cycle(graph, frozenset({"a", "b", "c"})) == ["a", "b", "c", "a"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The reader resolves what the real modules use: absolute, `from pkg import module`, relative, function-level."""
    source = "import os\nfrom . import b\nfrom .c import thing\ndef f():\n    from pkg.d import x\n    import pkg.e.sub\n"
    ours = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e"}
    found = set().union(*(_imported(n, "pkg.a", False, ours) for n in ast.walk(ast.parse(source))))
    assert found == {"pkg.b", "pkg.c", "pkg.d", "pkg.e"}
    graph = import_graph()  # ... and reads the real modules: edges this project is known to have
    assert {"parity.layouts", "parity.canonical", "mha_spec"} <= graph["parity.convert"]
    assert {"mha_torch", "mha_jax"} <= graph["parity.convert"]  # imported inside from_torch / from_jax only
    assert "parity.convert" not in graph["parity.layouts"]  # layouts builds on canonical; convert re-exports layouts
