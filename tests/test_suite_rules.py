"""Rules of the suite itself: test files share helpers through ``tests.support`` (or a folder's
underscore module, as ``fsdp2_compat/_compat.py``), never by importing another test file."""

import ast

from tests.support.launched import REPO


def _imported_modules(path):
    package = ".".join(path.relative_to(REPO).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_no_test_file_imports_another():
    offenders = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for module in _imported_modules(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert offenders == []
