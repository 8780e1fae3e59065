"""The package's layer rule, checked on its source: every import (lazy and TYPE_CHECKING ones
included) goes to the importer's own folder or to a lower layer; folders on one layer never import
each other; no import cycle at all, between folders or inside one.

LAYERS is the map docs/architecture.md draws, lowest first. A new top-level module or folder must
be placed in it, so its place in the data flow is a decision, not an accident.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

import activation_guard

PKG = "activation_guard"
ROOT = Path(activation_guard.__file__).parent

LAYERS: list[set[str]] = [
    {"_version", "_core"},
    {"fingerprints"},
    {"values", "options", "results"},
    {"store"},
    {"capture", "distributed", "graphs", "runtimes"},
    {"gradients"},
    {"judges"},
    {"calibration"},
    {"replay"},
    {"comparison", "quantization"},
    {"report"},
    {"api"},
    {"plugin", "cli"},
    {"testing", "__main__"},
]
# the package's own __init__ re-exports the public names lazily: it is the facade above every layer
FACADE = PKG


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    line: int
    type_only: bool


def module_names(root: Path) -> dict[str, Path]:
    mods = {}
    for p in root.rglob("*.py"):
        parts = (PKG, *p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def module_edges(name: str, source: str, is_package: bool, modules: set[str]) -> list[Edge]:
    """Every import of ``name``'s source that names a module of the package (the module itself,
    or the module a ``from X import name`` takes ``name`` from)."""
    tree = ast.parse(source)
    type_only = _type_checking_lines(tree)
    here = name.split(".") if is_package else name.split(".")[:-1]
    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [mod, *subs]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            if t != name and (t == PKG or t.startswith(PKG + ".")):
                edges.append(Edge(name, t, node.lineno, node.lineno in type_only))
    return edges


def package_edges(root: Path = ROOT) -> list[Edge]:
    return list(_package_edges(root))


@functools.cache
def _package_edges(root: Path) -> tuple[Edge, ...]:
    mods = module_names(root)
    out: list[Edge] = []
    for name, path in sorted(mods.items()):
        out += module_edges(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", set(mods))
    return tuple(out)


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def layer_of(module: str) -> int:
    t = top(module)
    if t == FACADE:
        return len(LAYERS)
    for i, names in enumerate(LAYERS):
        if t in names:
            return i
    raise KeyError(t)


def layer_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        s, d = top(e.src), top(e.dst)
        if s == d:
            continue
        if d == FACADE or layer_of(e.src) <= layer_of(e.dst):
            kind = "type-only import" if e.type_only else "import"
            where = "on the same layer as" if layer_of(e.src) == layer_of(e.dst) else "below"
            bad.append(f"{e.src} (line {e.line}): {kind} of {e.dst}, but {s!r} is {where} {d!r}")
    return bad


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), as a sorted list."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_top_level_name_has_a_layer() -> None:
    names = {top(m) for m in module_names(ROOT)} - {FACADE}
    placed = set().union(*LAYERS)
    assert names - placed == set(), "place these in LAYERS (and docs/architecture.md)"
    assert placed - names == set(), "LAYERS names something that no longer exists"


def test_no_import_reaches_up_or_sideways() -> None:
    assert layer_violations(package_edges()) == []


def test_no_import_cycle() -> None:
    # a cycle inside the facade is only its lazy re-exports pointing back at it: none exist
    assert cycles(package_edges()) == []


def test_every_subpackage_says_its_one_job() -> None:
    for init in sorted(ROOT.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{init} has no docstring"
        first = doc.splitlines()[0]
        assert first.endswith("."), f"{init}: the first line states the folder's job in one sentence"


def _edges_of(name: str, source: str, package: bool = False) -> list[Edge]:
    return module_edges(name, source, package, set(module_names(ROOT)))


@pytest.mark.parametrize(
    "name, source",
    [
        ("activation_guard._core.errors", "from ..report.report import Report\n"),
        ("activation_guard.store.reader", "def f():\n    from ..capture import hooks\n"),
        ("activation_guard.values.leaves", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from ..options.spec import CompareSpec\n"),
        ("activation_guard.capture.hooks", "import activation_guard.distributed.ranks\n"),
        ("activation_guard.judges.strict", "from activation_guard import api\n"),
    ],
    ids=["upward", "upward-lazy", "sideways-type-only", "sideways-absolute", "the-facade"],
)
def test_the_rule_fails_on_a_bad_import(name: str, source: str) -> None:
    bad = layer_violations(package_edges() + _edges_of(name, source))
    assert len(bad) == 1 and bad[0].startswith(name), bad


def test_a_type_only_cycle_is_a_cycle() -> None:
    # the store's naming imports nothing of the package; a type-only import back from it closes a
    # loop with the distributed ranks module, which imports it
    extra = _edges_of("activation_guard.store.naming", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                         "    from ..store import reader\n")
    extra += _edges_of("activation_guard.store.reader", "from . import naming\n")
    found = cycles(package_edges() + extra)
    assert found and {"activation_guard.store.naming", "activation_guard.store.reader"} <= set(found[0])
