"""The package's structure: a package's underscore modules and names are its own,
imports between modules make no circle, and the replicated tier lives in
``replicate/``, the bus carries events only."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "coordinator"


def _modules() -> list[tuple[str, Path]]:
    """Every module of ``coordinator`` as (dotted name, path)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append((".".join(parts), path))
    return found


def _package_of(module: str, path: Path) -> str:
    """The package a module belongs to: itself for a package's ``__init__``."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, absolute module imported, name imported from it or None)."""
    package = _package_of(module, path)
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found += [(node.lineno, target, alias.name) for alias in node.names]
    return found


def _private_owner(target: str, name: str | None) -> str | None:
    """The package whose private module or name this import reaches, if any."""
    parts = target.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_") and index > 0:
            return ".".join(parts[:index])
    if name is not None and name.startswith("_") and name != "__version__":
        is_package = (PACKAGE.parent / target.replace(".", "/")).is_dir()
        return target if is_package else target.rpartition(".")[0]
    return None


def test_no_module_imports_another_packages_private_modules_or_names() -> None:
    """A package's underscore modules and names are its own: another package
    imports only what a package exports (``coordinator.bus._nats`` from
    ``coordinator.remote`` is refused, as is ``coordinator._errors`` from
    ``coordinator.store``)."""
    breaks = []
    for module, path in _modules():
        own = _package_of(module, path)
        for line, target, name in _imports(module, path):
            if not target.startswith("coordinator"):
                continue
            owner = _private_owner(target, name)
            if owner is not None and owner != own:
                breaks.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target} {name or ''}")
    assert breaks == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("from ..bus._nats import NatsBus", "coordinator.bus", id="private-module"),
        pytest.param("from ..store import _helper", "coordinator.store", id="private-name"),
        pytest.param("from .._errors import X", "coordinator", id="root-private-module"),
        pytest.param("from ..bus import NatsBus", None, id="public"),
    ],
)
def test_the_rule_sees_each_kind_of_reach(source: str, expected: str | None) -> None:
    """The checker itself: each way of reaching a private part is seen."""
    tree = ast.parse(source)
    node = tree.body[0]
    assert isinstance(node, ast.ImportFrom)
    base = ["coordinator", "replicate"][: 2 - (node.level - 1)]
    target = ".".join([*base, *([node.module] if node.module else [])])
    assert _private_owner(target, node.names[0].name) == expected


def _import_graph() -> dict[str, dict[str, str]]:
    """module -> {module it imports: where (path:line)}, for every import inside
    ``coordinator``, at any depth (in functions, under ``TYPE_CHECKING``: a
    circle hidden there is still one). ``from .pkg import sub`` is an edge to
    the module ``pkg.sub`` when that is one, else to ``pkg``."""
    modules = dict(_modules())
    graph: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, target, name in _imports(module, path):
            wanted = f"{target}.{name}" if f"{target}.{name}" in modules else target
            if wanted in modules and wanted != module:
                edges.setdefault(wanted, f"{path.relative_to(PACKAGE.parent)}:{line}")
    return graph


def _circles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), as a path
    around it: the circles of ``graph``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(_path_around(graph, sorted(members)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_around(graph: dict[str, Iterable[str]], members: list[str]) -> list[str]:
    """A shortest way from the first member back to itself, inside ``members``."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    queue = [start]
    for node in queue:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*paths[node], start]
            if nxt in inside and nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"no way around {members}")


def test_imports_between_modules_make_no_circle() -> None:
    """Imports point downward only: no module reaches itself through others,
    function-level imports included (``store._manifest`` imported ``check_consistent``
    from ``store._lineage`` inside a function, which imported ``_manifest``)."""
    graph = _import_graph()
    shown = [
        "; ".join(f"{a} -> {b} ({graph[a][b]})" for a, b in itertools.pairwise(circle))
        for circle in _circles(graph)
    ]
    assert shown == []


def test_the_circle_finder_sees_a_circle() -> None:
    """The checker itself: a circle of three is found, a fork that joins again is not."""
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert _circles({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}) == []


def test_the_bus_carries_events_only() -> None:
    """Nothing of the replicated tier is left in ``bus/``: no object store, no
    pointer, no lease."""
    for path in (PACKAGE / "bus").glob("*.py"):
        text = path.read_text()
        for word in ("object_store", "Replicat", "SessionLease", "CKPT_REPLICAS"):
            assert word not in text, f"{path.name} mentions {word}"
