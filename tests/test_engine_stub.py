"""moeinf/_engine.pyi must describe the compiled module: same names, same methods."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import moeinf
from moeinf import _engine

STUB = Path(moeinf.__file__).parent / "_engine.pyi"


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(STUB.read_text())
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            members[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names, members


def _public(names: list[str]) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_stub_lists_exactly_the_module_names() -> None:
    names, _ = _stub_names()
    assert names == _public(dir(_engine))


def test_stub_lists_exactly_the_methods_of_each_class() -> None:
    _, members = _stub_names()
    for cls_name, stub_methods in members.items():
        cls = getattr(_engine, cls_name)
        if inspect.isclass(cls) and issubclass(cls, BaseException):
            continue
        assert _public(stub_methods) == _public(dir(cls)), cls_name
