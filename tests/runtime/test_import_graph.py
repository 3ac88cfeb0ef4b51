"""Inside ``runtime/`` and ``dbuffer/`` calls go down: no module imports one that imports it
back, not even under ``if TYPE_CHECKING:`` (a type-only import back is a call back in waiting,
and the layer contracts in ``pyproject.toml`` hold only while there is none)."""

import ast
from pathlib import Path

import pytest

import vescale_plugins

_ROOT = Path(vescale_plugins.__file__).parent


def _imports(package: str) -> dict[str, set[str]]:
    """Each module of ``vescale_plugins.<package>`` and the modules of the same package it
    imports anywhere in its source (``TYPE_CHECKING`` blocks and function bodies too)."""
    prefix = f"vescale_plugins.{package}"
    modules = {path.stem for path in (_ROOT / package).glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        found: set[str] = set()
        for node in ast.walk(ast.parse((_ROOT / package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.module.startswith(prefix + "."):
                    found.add(node.module[len(prefix) + 1 :].split(".")[0])
                elif node.module == prefix:
                    found.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.Import):
                found.update(
                    alias.name[len(prefix) + 1 :].split(".")[0]
                    for alias in node.names
                    if alias.name.startswith(prefix + ".")
                )
        graph[name] = (found & modules) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_cycle_finder_finds_a_type_only_cycle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


@pytest.mark.parametrize("package", ["runtime", "dbuffer"])
def test_no_import_cycle_counting_type_checking_imports(package):
    graph = _imports(package)
    assert len(graph) > 5, graph  # the package was found and parsed
    assert _cycles(graph) == []
