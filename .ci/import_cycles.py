"""Fails when modules of `cadence` import each other in a cycle, directly or through others.

import-linter's contracts (pyproject.toml) keep the layers apart; a cycle between two modules of one
layer is what they cannot see, and what makes a module impossible to read or test without the other.
Imports under `if TYPE_CHECKING:` do not count: they never run. The graph is grimp's, the library
import-linter builds on.
"""

from __future__ import annotations

import sys

import grimp


def cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next((c for c in children if c.startswith(package + ".")), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    graph = grimp.build_graph("cadence", exclude_type_checking_imports=True)
    found = cycles(graph, "cadence")
    for component in found:
        print("import cycle: " + " <-> ".join(component), file=sys.stderr)
    if not found:
        print("import cycles: none")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
