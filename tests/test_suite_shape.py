"""The suite's own shape: no test file imports another test file, nor conftest (checked from the source,
imports inside functions included). What test files share lives in tests/support/, which imports no
test file either -- so moving or splitting a test file never breaks another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, at module level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def forbidden(module: str) -> bool:
    """A test module, or pytest's conftest (shared helpers belong in support/)."""
    top = module.split(".")[0]
    return top.startswith("test_") or top == "conftest"


def test_no_test_file_imports_another_test_file_or_conftest():
    files = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "support").glob("*.py"))
    assert len(files) > 50 and TESTS / "test_suite_shape.py" in files  # the glob found the suite
    found = [f"{path.relative_to(TESTS)}:{line}: imports {module}" for path in files for line, module in imported_modules(path)
             if forbidden(module)]
    assert not found, "move what they share into tests/support/ and import it from there:\n" + "\n".join(found)


def test_the_check_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text("import os\nfrom support.pools import slots\n\ndef test_x():\n    from test_other import thing\n    import conftest\n")
    assert [m for _, m in imported_modules(path) if forbidden(m)] == ["test_other", "conftest"]
