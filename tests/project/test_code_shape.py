"""The shape docs/architecture.md asks of the code: the training loop names no objective and no
adapter, the trainer reads as the algorithm, functions fit a screen unless a comment says why,
and the modules of one package import no cycle.

Lengths count code lines only: docstrings, comments and blank lines aside, so that no number here
is ever a reason to shorten a docstring or to pack lines (the numbers are guides to readable
code, and `ruff format` decides how a statement is wrapped)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.builders import ROOT

LOOP = ROOT / "pipeline" / "train" / "loop"
LOOP_FILES = ["trainer.py", "train_step.py", "step_runner.py", "pipeline_step.py"]
# An objective's or an adapter's name, or a test of the data's kind.
NAMED_OBJECTIVE = re.compile(r"\b(dpo|sft|grpo|lora|preference)\b|\bkind\s*[!=]=", re.IGNORECASE)
LONG_FUNCTION = 60
TRAINER_CODE_LINES = 320
LONG_ALLOWED = 2
LONG_REASON = "# Long on purpose:"


def test_the_loop_names_no_objective() -> None:
    found = []
    for name in LOOP_FILES:
        for number, line in enumerate((LOOP / name).read_text().splitlines(), 1):
            if NAMED_OBJECTIVE.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "the loop names an objective:\n" + "\n".join(found)


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The line numbers of every docstring in `tree` (module, classes, functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found |= set(range(first.lineno, first.end_lineno + 1))
    return found


def _code_lines(source: str) -> set[int]:
    """The numbers of the lines of `source` that hold code: not blank, not only a comment, not
    in a docstring."""
    docstrings = _docstring_lines(ast.parse(source))
    return {
        number
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    }


def test_code_lines_leave_docstrings_and_comments_out() -> None:
    source = 'def f():\n    """Say\n    why."""\n\n    # a comment\n    return 1\n'
    assert _code_lines(source) == {1, 6}


def test_the_trainer_is_short() -> None:
    lines = len(_code_lines((LOOP / "trainer.py").read_text()))
    assert lines <= TRAINER_CODE_LINES, f"trainer.py has {lines} lines of code"


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_functions_fit_a_screen_unless_a_comment_says_why() -> None:
    long, unexplained = [], []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        source = path.read_text()
        lines, code = source.splitlines(), _code_lines(source)
        for node in _functions(path):
            length = len([n for n in code if node.lineno <= n <= node.end_lineno])
            if length <= LONG_FUNCTION:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} code lines)"
            long.append(where)
            if not any(LONG_REASON in line for line in lines[node.lineno - 1 : node.end_lineno]):
                unexplained.append(where)
    assert not unexplained, f"over {LONG_FUNCTION} lines without '{LONG_REASON}': {unexplained}"
    assert len(long) <= LONG_ALLOWED, f"more than {LONG_ALLOWED} long functions: {long}"


def _imports(path: Path, package: str) -> set[str]:
    """The modules of `package` that the module at `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
    return found


def test_the_model_modules_import_no_cycle() -> None:
    package = "pipeline.core.model"
    folder = ROOT / "pipeline" / "core" / "model"
    graph = {f"{package}.{p.stem}": _imports(p, package) for p in folder.glob("*.py")}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    cycles = [module for module in graph if reaches(module, module, {module})]
    assert not cycles, f"modules in an import cycle: {cycles}"
