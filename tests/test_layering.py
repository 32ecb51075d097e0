"""The package's structure is a contract: layers, no import circles, small files and functions.

The import contracts live in pyproject.toml (``[tool.importlinter]``) and are checked by
import-linter, which reads every import statement of the package (function-local ones too)
without running it. The size limits are the style guide's (files <= 600 lines, functions <= 80):
a bigger one is a sign that two things share a room. The last two tests keep the two doors
that the restructure made single: one ``unwrap`` and one place that reads megatron's
process-global ``parallel_state``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl_megatron"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def test_import_contracts_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, (
        "import contracts broken (pyproject.toml [tool.importlinter]):\n" + report[-6000:]
    )
    assert "2 kept, 0 broken" in report, report[-3000:]


def test_files_and_functions_stay_small():
    too_long = []
    for path, tree in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines (file)")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, (
        f"over {MAX_FILE_LINES} lines a file / {MAX_FUNCTION_LINES} a function:\n" + "\n".join(too_long)
    )


def test_one_unwrap():
    definitions = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name in ("unwrap", "_unwrap")
    ]
    assert len(definitions) == 1 and "/distributed/" in definitions[0], definitions


def test_only_distributed_reads_megatron_parallel_state():
    readers = []
    for path, tree in _sources():
        if path.parent.name == "distributed":
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if any(name.endswith("megatron.core.parallel_state") for name in names):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, f"megatron's parallel_state read outside distributed/: {readers}"
