"""The import graph of hybridpipe (DESIGN.md, "Packages"): no circles, and no import running back up.

Every ``import`` / ``from ... import`` statement of every module counts, wherever it stands (inside a
function, under ``TYPE_CHECKING``): a circle hidden in a function is still a circle. Read with ``ast``,
nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

# lowest first: a module may import modules of its own layer or of a lower one, never of a higher one
PACKAGE_ORDER: tuple[tuple[str, ...], ...] = (
    ("hybridpipe.errors", "hybridpipe.jsonfile", "hybridpipe.limits", "hybridpipe.argtypes", "hybridpipe.units"),
    ("hybridpipe.profiles",),
    ("hybridpipe.partitioner",),
    ("hybridpipe.comm",),                 # its auto choice reads the partitioner's cost model
    ("hybridpipe.pipeline",),
    ("hybridpipe.runtime",),
    ("hybridpipe.commands",),
    ("hybridpipe", "hybridpipe.cli", "hybridpipe.launch"),     # the edges: the package's API, the commands
)
# inside the partitioner, likewise; a top-level module not named here sits between cost/ and search/
PARTITIONER_ORDER: tuple[tuple[str, ...], ...] = (
    ("hybridpipe.partitioner.cost",),     # the cost model: all comm may import of the partitioner
    ("hybridpipe.partitioner", "hybridpipe.partitioner.chunk_orders", "hybridpipe.partitioner.schedule_registry",
     "hybridpipe.partitioner.plan", "hybridpipe.partitioner.tied"),
    ("hybridpipe.partitioner.search",),
    ("hybridpipe.partitioner.planner",),
    ("hybridpipe.partitioner.joint",),   # the loop over schedule x virtual stages x precision around the planner
    ("hybridpipe.partitioner.refine",),
)
# what a package may import of another one (beyond the order above)
ONLY: dict[str, tuple[str, ...]] = {"hybridpipe.comm": ("hybridpipe.partitioner.cost",)}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "hybridpipe") -> nx.DiGraph:
    """Modules of ``package`` under ``root`` -> the modules of the package they import (edge data: line)."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:       # an attribute of a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def place(module: str, order: tuple[tuple[str, ...], ...]) -> int | None:
    """The layer of ``module``: the one with the longest prefix of it (None: no layer names it)."""
    best, layer = -1, None
    for k, prefixes in enumerate(order):
        for p in prefixes:
            if (module == p or (module.startswith(p + ".") and p != "hybridpipe")) and len(p) > best:
                best, layer = len(p), k
    return layer


def upward_imports(graph: nx.DiGraph, order: tuple[tuple[str, ...], ...], within: str = "") -> list[str]:
    """Imports from a lower layer to a higher one (between modules under ``within``)."""
    out = []
    for a, b, data in graph.edges(data=True):
        if within and not (a.startswith(within) and b.startswith(within)):
            continue
        la, lb = place(a, order), place(b, order)
        if la is not None and lb is not None and la < lb:
            out.append(f"{a} (line {data['line']}) imports {b}, which is above it")
    return sorted(out)


def cycles(graph: nx.DiGraph) -> list[str]:
    """Every circle, written from its first module in sorted order."""
    out = []
    for c in nx.simple_cycles(graph):
        k = c.index(min(c))
        c = c[k:] + c[:k]
        out.append(" -> ".join([*c, c[0]]))
    return sorted(out)


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph(ROOT)


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_every_module_has_a_place_in_the_package_order(graph):
    assert [m for m in graph if place(m, PACKAGE_ORDER) is None] == []


def test_imports_go_one_way_between_packages(graph):
    assert upward_imports(graph, PACKAGE_ORDER) == []


def test_imports_go_one_way_inside_the_partitioner(graph):
    inside = [m for m in graph if m.startswith("hybridpipe.partitioner")]
    assert [m for m in inside if place(m, PARTITIONER_ORDER) is None] == []
    assert upward_imports(graph, PARTITIONER_ORDER, within="hybridpipe.partitioner") == []


def test_comm_imports_only_the_cost_model_of_the_partitioner(graph):
    for package, allowed in ONLY.items():
        bad = [f"{a} imports {b}" for a, b in graph.edges
               if a.startswith(package + ".") and b.startswith("hybridpipe.partitioner")
               and not any(b == x or b.startswith(x + ".") for x in allowed)]
        assert bad == []


def test_the_checks_see_a_planted_circle_and_an_upward_import(tmp_path):
    """The checks themselves, on a package written here: a circle through a function-level import,
    and a relative import from a lower layer to a higher one."""
    pkg = tmp_path / "hybridpipe"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from hybridpipe.low.b import g\n")
    (pkg / "low" / "b.py").write_text("from hybridpipe.low import a\nfrom ..high import h\n")
    (pkg / "high.py").write_text("h = 1\n")
    planted = import_graph(tmp_path)
    assert cycles(planted) == ["hybridpipe.low.a -> hybridpipe.low.b -> hybridpipe.low.a"]
    order = (("hybridpipe.low",), ("hybridpipe.high",))
    assert upward_imports(planted, order) == ["hybridpipe.low.b (line 2) imports hybridpipe.high, which is above it"]
