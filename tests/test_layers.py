"""The package's layers, read from its own imports: no import circle and no import from a lower layer to a
higher one (every `import` counts, at module level, inside functions and under `TYPE_CHECKING`)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moeinf"

LAYERS: list[tuple[str, ...]] = [
    # bottom: what knows no other part of moeinf (the spec table: per-architecture facts; free disk space)
    ("moeinf._engine", "moeinf._kernels", "moeinf.config", "moeinf.disk", "moeinf.progress", "moeinf.spec"),
    ("moeinf.engine", "moeinf.policy"),  # bytes (the I/O engine) and decisions (pure policies)
    ("moeinf.store",),  # the packed expert store and its formats, built from a checkpoint per its spec
    ("moeinf.kernels",),  # tensor math: expert compute, quantised products over the store's layouts
    ("moeinf.hf",),  # transformers' models: experts modules swapped for moeinf's, the model skeleton
    ("moeinf.trace",),  # routing traces and EAMCs
    ("moeinf.zoo", "moeinf.hub"),  # shipped models, and model references resolved to checkpoints
    ("moeinf.runtime",),  # residency: tiers, cache, offloader, the offloaded experts modules
    ("moeinf.models",),  # per-architecture fast paths patched into one model instance
    ("moeinf.builder",),  # assembles one offloaded model from all of the above
    ("moeinf.parallel",),  # expert parallelism: ranks that each build their share
    ("moeinf.api", "moeinf"),  # `MoE`, and the package's exports
    ("moeinf.serve", "moeinf.batch"),  # the server and offline batches, over the API
    ("moeinf.replay",),
    ("moeinf.bench",),
    ("moeinf.commands",),
    ("moeinf.cli", "moeinf.__main__"),  # the edge: the command line
]
"""Lowest first. A unit is a top-level module or subpackage of moeinf (`moeinf` itself: its `__init__`)."""


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their own name); stubs of compiled ones."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = ("moeinf", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.setdefault(name, path)
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The moeinf modules `name` (at `path`) imports, each the longest known module its import names."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                out.add(target)
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


@functools.cache
def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported(name, path, known) for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_circle_finder_finds_a_circle_and_nothing_else() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules() -> None:
    assert circles(graph()) == []


def test_no_import_circle_between_packages() -> None:
    units: dict[str, set[str]] = {}
    for module, targets in graph().items():
        units.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    assert circles(units) == []


def test_every_unit_has_a_declared_layer() -> None:
    declared = {u for layer in LAYERS for u in layer}
    missing = sorted({unit(m) for m in modules()} - declared)
    assert not missing, f"declare the layer of {missing} in LAYERS"


@pytest.mark.parametrize("rank", range(len(LAYERS)), ids=[layer[0] for layer in LAYERS])
def test_no_import_runs_up_the_layers(rank: int) -> None:
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    upward = sorted(f"{module} imports {target}" for module, targets in graph().items()
                    if level.get(unit(module)) == rank for target in targets
                    if level.get(unit(target), -1) > rank)
    assert not upward
