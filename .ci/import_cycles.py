"""Fails when modules of `cadence` import each other in a cycle, directly or through others.

import-linter's contracts (pyproject.toml) keep the layers apart; a cycle between two modules of one
layer is what they cannot see, and what makes a module impossible to read or test without the other.
Imports under `if TYPE_CHECKING:` do not count: they never run. The graph is grimp's, the library
import-linter builds on: an import a -> b closes a cycle exactly when b reaches a again.
"""

from __future__ import annotations

import sys

import grimp


def cycles(graph: grimp.ImportGraph, package: str) -> list[tuple[str, ...]]:
    """One shortest cycle through each import that closes one, each cycle listed once."""
    found: set[tuple[str, ...]] = set()
    for importer in sorted(m for m in graph.modules if m.startswith(package + ".")):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported.startswith(package + ".") and graph.chain_exists(importer=imported, imported=importer):
                back = graph.find_shortest_chain(importer=imported, imported=importer) or ()
                cycle = (importer, *back[:-1])
                start = cycle.index(min(cycle))  # one rotation, so each cycle is reported once
                found.add(cycle[start:] + cycle[:start])
    return sorted(found)


def main() -> int:
    graph = grimp.build_graph("cadence", exclude_type_checking_imports=True)
    found = cycles(graph, "cadence")
    for cycle in found:
        print("import cycle: " + " -> ".join((*cycle, cycle[0])), file=sys.stderr)
    if not found:
        print("import cycles: none")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
