"""The scheduler's modules import one way: no import circle among them.

lint-imports' contracts keep the packages apart; this keeps the modules of
`caravan_llm.scheduler` (and of the shared `caravan_llm.common`) from closing a circle (observe ->
assess -> plan -> controller must stay a line, never a loop back through the
controller; the engine adapters never import the profile that names them).
"""

from __future__ import annotations

from collections.abc import Iterator

import grimp


def circles(graph: grimp.ImportGraph, package: str) -> Iterator[frozenset[str]]:
    """The strongly connected components of more than one module of `package` (Tarjan)."""
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in modules:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    yield frozenset(component)


def test_the_scheduler_has_no_import_circle_at_runtime() -> None:
    """What Python imports when the scheduler starts is a line, never a circle."""
    graph = grimp.build_graph("caravan_llm", exclude_type_checking_imports=True, cache_dir=None)
    assert [] == list(circles(graph, "caravan_llm.scheduler"))


def test_type_only_imports_close_no_circle_either() -> None:
    """Counting imports for type checkers too, the modules form no circle.

    The profile once asked the engine registry from a validator while the adapters
    typed against the profile (issue 22): adapters now read a profile through
    `EngineProfile`, and the schema of `weights:` sits below both.
    """
    graph = grimp.build_graph("caravan_llm", cache_dir=None)
    assert [] == list(circles(graph, "caravan_llm.scheduler"))


def test_the_shared_package_has_no_import_circle() -> None:
    """`caravan_llm.common`, which both processes import, is a line too, type-only imports
    counted."""
    graph = grimp.build_graph("caravan_llm", cache_dir=None)
    assert [] == list(circles(graph, "caravan_llm.common"))
