"""No import cycles among the project's modules (issue 13, DESIGN rule 6).

Counted on grimp's graph, the one import-linter checks the layering contracts on
(``[tool.importlinter]`` in pyproject.toml; ``.ci/run`` runs ``lint-imports``): it holds the
imports written inside functions, which once hid a 12-module cycle from anyone reading the
tops of the files, and leaves out those under ``if TYPE_CHECKING:``, which never run.
A cycle is found as a strongly connected component of more than one module: grimp offers no
helper for a whole graph (``nominate_cycle_breakers`` looks at one package's children).
"""

from __future__ import annotations

import tomllib
from collections import deque
from collections.abc import Iterable, Mapping
from itertools import pairwise
from pathlib import Path

import grimp

BASE_DIR = Path(__file__).resolve().parent.parent
IMPORT_LINTER = tomllib.loads((BASE_DIR / "pyproject.toml").read_text())["tool"]["importlinter"]
ROOT_PACKAGES = IMPORT_LINTER["root_packages"]

Graph = Mapping[str, Iterable[str]]


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components, iteratively (a recursive walk of a long import chain could
    exceed Python's recursion limit). Every module is in exactly one component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            module, imported = work[-1]
            for target in imported:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[module] = min(low[module], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside it."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph[module]):
            if target not in inside:
                continue
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if target not in came_from:
                came_from[target] = module
                queue.append(target)
    raise AssertionError(f"{component} is not a cycle")


def import_graph(*packages: str, cache_dir: str | None = None) -> grimp.ImportGraph:
    return grimp.build_graph(*packages, exclude_type_checking_imports=True, cache_dir=cache_dir)


def cycles_of(graph: grimp.ImportGraph) -> list[str]:
    """Each cycle as ``a -> b (l.3) -> a (l.12)``, then every import inside its component
    (the imports to cut: one component may hold several cycles)."""
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}

    def lines(importer: str, imported: str) -> str:
        details = graph.get_import_details(importer=importer, imported=imported)
        return ", ".join(f"l.{d['line_number']}" for d in details)

    found = []
    for component in strongly_connected(edges):
        if len(component) < 2:
            continue
        cycle = shortest_cycle(edges, component)
        steps = [cycle[0]] + [f"{b} ({lines(a, b)})" for a, b in pairwise(cycle)]
        inside = [
            f"    {a} -> {b} ({lines(a, b)})"
            for a in component
            for b in sorted(edges[a])
            if b in component
        ]
        found.append(f"{len(component)} modules: " + " -> ".join(steps) + "\n" + "\n".join(inside))
    return found


def test_the_project_graph_is_the_one_import_linter_checks() -> None:
    assert set(ROOT_PACKAGES) == {
        "config",
        "workflows",
        "runs",
        "workers",
        "approvals",
        "schedules",
    }
    assert IMPORT_LINTER["exclude_type_checking_imports"] is True


def test_components_of_a_small_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": set()}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    # A long chain: no recursion limit.
    chain = {str(i): {str(i + 1)} for i in range(5000)} | {"5000": {"0"}}
    assert [len(c) for c in strongly_connected(chain)] == [5001]


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path, monkeypatch) -> None:
    """The graph holds imports written in function bodies and leaves out TYPE_CHECKING ones:
    what this file's main test relies on."""
    package = tmp_path / "toy_cycles"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def later():\n    from toy_cycles import high\n")
    (package / "high.py").write_text("from toy_cycles import low, typed\n")
    # Were this import counted, high and typed would be a second cycle.
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from toy_cycles import high\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    [cycle] = cycles_of(import_graph("toy_cycles"))
    assert cycle.startswith(
        "2 modules: toy_cycles.high -> toy_cycles.low (l.1) -> toy_cycles.high (l.2)"
    )


def test_no_import_cycles() -> None:
    cycles = cycles_of(import_graph(*ROOT_PACKAGES))
    for cycle in cycles:
        print(cycle)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
