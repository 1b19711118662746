"""The package's layering, read off the source (ast, nothing imported).

The simulator and the core have no import cycle (a cycle hidden behind a function-local import
still counts: every import statement of a module is an edge, wherever it sits, and importing
``a.b.c`` is an edge to the packages ``a.b`` and ``a`` too, whose ``__init__`` runs first; and so
does a type-only one, under ``if TYPE_CHECKING:``: two modules that name each other's types are
one design split in two, whichever import runs), the core
imports nothing outside itself, and nothing under backends/ imports the simulator. Run as a script
it prints every cycle and every backends -> sim import it finds.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The source folders and the package names they install as (setup.py's ROOTS).
ROOTS = {"kvferry": "kvferry", "kvferry.core": "core", "kvferry.backends": "backends", "kvferry.sim": "sim"}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    out: dict[str, Path] = {}
    for package, folder in ROOTS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "kvferry" and parts and parts[0] in ("core", "backends", "sim"):
                continue  # not installed from there
            out[".".join((package, *parts))] = path
    return out


def _targets(node: ast.AST, name: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            mod = ".".join([*base, *([node.module] if node.module else [])])
        else:
            mod = node.module or ""
        yield mod
        for alias in node.names:  # ``from pkg import module`` names a module too
            yield f"{mod}.{alias.name}"


def edges(
    tree: ast.Module, name: str, is_package: bool, mods: set[str] | dict[str, Path], types: bool
) -> set[str]:
    """The package modules that module ``name`` imports: every import statement, at the top or
    inside a function, and with ``types`` those under ``if TYPE_CHECKING:`` too."""
    nodes: list[ast.AST] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            nodes.append(node)
        else:
            stack.extend(ast.iter_child_nodes(node))
    out = set()
    for node in nodes:
        for target in _targets(node, name, is_package):
            parts = target.split(".")
            # Importing a.b.c runs the packages a.b and a first: each is an edge too.
            for n in range(len(parts), 0, -1):
                mod = ".".join(parts[:n])
                if mod in mods and mod != name and not name.startswith(mod + "."):
                    out.add(mod)
    return out


def import_graph(types: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``types``: type-only imports count too)."""
    mods = modules()
    return {
        name: edges(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", mods, types)
        for name, path in mods.items()
    }


def cycles(graph: dict[str, set[str]], prefixes: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected components of more than one module among those under ``prefixes``
    (Tarjan's algorithm), each sorted."""
    nodes = {n for n in graph if n.startswith(prefixes)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in nodes:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(nodes):
        if v not in index:
            connect(v)
    return sorted(found)


LAYERED = ("kvferry.core", "kvferry.sim")


def test_no_import_cycle_in_the_core_or_the_simulator() -> None:
    found = cycles(import_graph(), LAYERED)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_type_only_import_is_an_edge() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvferry.sim.world import World\n"
    mods = {"kvferry.sim.chaos", "kvferry.sim.world", "kvferry.sim"}
    tree = ast.parse(source)
    assert edges(tree, "kvferry.sim.chaos", False, mods, types=True) == {"kvferry.sim.world"}
    assert edges(tree, "kvferry.sim.chaos", False, mods, types=False) == set()


def test_backends_never_import_the_simulator() -> None:
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in import_graph().items()
        if m.startswith("kvferry.backends")
        for t in targets
        if t.startswith("kvferry.sim")
    )
    assert not bad, bad


def test_the_core_imports_nothing_above_it() -> None:
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in import_graph().items()
        if m.startswith("kvferry.core")
        for t in targets
        if not t.startswith("kvferry.core")
    )
    assert not bad, bad


def test_the_check_finds_a_cycle() -> None:
    graph = {"kvferry.sim.a": {"kvferry.sim.b"}, "kvferry.sim.b": {"kvferry.sim.a"}, "kvferry.sim.c": set()}
    assert cycles(graph, LAYERED) == [["kvferry.sim.a", "kvferry.sim.b"]]


if __name__ == "__main__":
    g = import_graph()
    for c in cycles(g, LAYERED):
        print(" <-> ".join(c))
    for m, targets in sorted(g.items()):
        for t in sorted(targets):
            if m.startswith("kvferry.backends") and t.startswith("kvferry.sim"):
                print(f"{m} -> {t}")
