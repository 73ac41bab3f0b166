"""moeinf/_engine.pyi and moeinf/_kernels.pyi must describe the compiled modules: same names, same methods."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import moeinf
from moeinf import _engine, _kernels

MODULES = [pytest.param(_engine, id="_engine"), pytest.param(_kernels, id="_kernels")]


def _stub_names(module: ModuleType) -> tuple[set[str], dict[str, set[str]]]:
    stub = Path(moeinf.__file__).parent / f"{module.__name__.rsplit('.', 1)[1]}.pyi"
    tree = ast.parse(stub.read_text())
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


@pytest.mark.parametrize("module", MODULES)
def test_stub_lists_exactly_the_module_names(module: ModuleType) -> None:
    names, _ = _stub_names(module)
    assert names == _public(dir(module))


@pytest.mark.parametrize("module", MODULES)
def test_stub_lists_exactly_the_methods_of_each_class(module: ModuleType) -> None:
    _, members = _stub_names(module)
    for cls_name, stub_methods in members.items():
        cls = getattr(module, cls_name)
        if inspect.isclass(cls) and (issubclass(cls, BaseException) or hasattr(cls, "__members__")):
            continue  # exceptions, and enums (their stub lists values, not methods)
        assert _public(stub_methods) == _public(dir(cls)), cls_name
