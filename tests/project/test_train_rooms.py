"""The training package's rooms (docs/architecture.md, "The training package"): they import
each other in one order, with no cycle, and no room but `objectives/` names an objective.

Every import counts, those inside functions and under `if TYPE_CHECKING:` included (none is
exempt: a type-only import upwards is still a room that knows one above it). An objective is
named by a comparison with the data's kind or by a string literal holding "dpo", "grpo" or
"sft"; docstrings (a bare string statement), comments and type annotations (`Literal[...]`) are
prose, not code, and may name one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.builders import ROOT

TRAIN = ROOT / "pipeline" / "train"

LEVELS = [
    {"config"},
    {"state"},
    {"objectives", "optimizers"},
    {"assembly", "report"},
    {"loop"},
    {"commands", "plot_command"},
]
"""The rooms from the bottom up: a room imports only rooms on a lower level. The config knows
no other room; the run state uses the config; the two registries (and the objectives' and
optimizers' modules) may use the run state; the model/data assembly and the reports ask the
registries; the loop runs what the assembly built; the commands sit on top."""

OBJECTIVE_WORD = re.compile(r"\b(dpo|grpo|sft)\b", re.IGNORECASE)


def _room(module: str) -> str | None:
    """The room of a `pipeline.train` module (None: outside the package, or its `__init__`)."""
    parts = module.split(".")
    if parts[:2] != ["pipeline", "train"] or len(parts) < 3:
        return None
    return parts[2]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str) -> list[str]:
    """The modules an import node names (a relative import resolved against `module`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".")[: -node.level]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def room_imports(train: Path) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> where, for every import between two rooms of `train`."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(train.rglob("*.py")):
        module = _module_name(path, train)
        source = _room(module)
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for name in _imported(node, module):
                target = _room(name)
                if target is not None and target != source:
                    where = f"{path.relative_to(train.parent.parent)}:{node.lineno}"
                    edges.setdefault((source, target), []).append(where)
    return edges


def _level(room: str) -> int | None:
    return next((i for i, rooms in enumerate(LEVELS) if room in rooms), None)


def order_violations(train: Path) -> list[str]:
    """Rooms no level places, and imports of a room on the same level or above."""
    rooms = {
        path.stem if path.parent == train else path.relative_to(train).parts[0]
        for path in train.rglob("*.py")
        if path != train / "__init__.py"
    }
    wrong = [f"room {r} has no level in LEVELS" for r in sorted(rooms) if _level(r) is None]
    for (source, target), where in sorted(room_imports(train).items()):
        low, high = _level(target), _level(source)
        if low is None or high is None or low >= high:
            wrong.append(f"{source} imports {target}: {', '.join(where)}")
    return wrong


def room_cycles(train: Path) -> list[list[str]]:
    """Every cycle of rooms importing each other (each once, from its first room in order)."""
    graph: dict[str, set[str]] = {}
    for source, target in room_imports(train):
        graph.setdefault(source, set()).add(target)
    cycles = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                cycles.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:
                walk([*path, nxt])

    for start in sorted(graph):
        walk([start])
    return cycles


def _prose(tree: ast.AST) -> set[int]:
    """Nodes that are prose, not code: docstrings (bare string statements) and everything
    inside a type annotation."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        annotations = []
        if isinstance(node, (ast.AnnAssign, ast.arg)) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            annotations.append(node.returns)
        for annotation in annotations:
            skip.update(id(n) for n in ast.walk(annotation))
    return skip


def _compares_kind(node: ast.Compare) -> bool:
    """A comparison that reads a `kind` attribute (`cfg.data.kind == ...`, `d.kind in ...`)."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == "kind"
        for side in (node.left, *node.comparators)
        for n in ast.walk(side)
    )


def objective_names(train: Path) -> list[str]:
    """Where code outside `objectives/` names an objective (see the module docstring)."""
    found = []
    for path in sorted(train.rglob("*.py")):
        if "objectives" in path.relative_to(train).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prose = _prose(tree)
        where = path.relative_to(train.parent.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and _compares_kind(node):
                found.append(f"{where}:{node.lineno}: compares the data's kind")
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in prose
                and OBJECTIVE_WORD.search(node.value)
            ):
                found.append(f"{where}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_the_rooms_import_in_one_order() -> None:
    wrong = order_violations(TRAIN)
    assert not wrong, "\n".join(wrong)


def test_the_rooms_import_no_cycle() -> None:
    cycles = room_cycles(TRAIN)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_only_objectives_name_an_objective() -> None:
    found = objective_names(TRAIN)
    assert not found, "an objective named outside objectives/:\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> Path:
    train = root / "pipeline" / "train"
    for name, text in {"__init__.py": "", **files}.items():
        (train / name).parent.mkdir(parents=True, exist_ok=True)
        (train / name).write_text(text)
    return train


def test_the_checks_catch_a_room_importing_upwards_and_a_cycle(tmp_path: Path) -> None:
    train = _write(
        tmp_path,
        {
            "config/schema.py": "def f():\n    from pipeline.train.loop import trainer\n",
            "loop/trainer.py": "from pipeline.train.config import schema\nTrainer = schema\n",
            "state/run_state.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..objectives import base\n"
            ),
            "objectives/base.py": "from pipeline.train.state import run_state\n",
            "kitchen/sink.py": "x = 1\n",
        },
    )
    wrong = order_violations(train)
    assert "room kitchen has no level in LEVELS" in wrong
    assert any(
        w.startswith("config imports loop: pipeline/train/config/schema.py:2") for w in wrong
    )
    assert any(w.startswith("state imports objectives") for w in wrong)  # type-only, relative
    assert not any(w.startswith("loop imports config") for w in wrong)  # downwards is fine
    assert ["config", "loop", "config"] in room_cycles(train)
    assert ["objectives", "state", "objectives"] in room_cycles(train)


def test_the_checks_catch_an_objective_named_outside_objectives(tmp_path: Path) -> None:
    train = _write(
        tmp_path,
        {
            "assembly/data.py": (
                '"""Builds SFT and DPO data."""\n'
                "from typing import Literal\n"
                'mode: Literal["grpo", "other"] = "other"\n'
                "def build(cfg):\n"
                '    """GRPO\'s prompts are data too."""\n'
                "    # a comment may say dpo\n"
                '    if cfg.data.kind == "x":\n'
                "        return 1\n"
                '    return {"Sft": 2}.get(cfg.name, f"for {cfg.name} (data.kind=dpo)")\n'
            ),
            "objectives/grpo/data.py": 'KIND = "grpo"\nok = lambda cfg: cfg.data.kind == KIND\n',
        },
    )
    found = objective_names(train)
    assert sorted(found) == [
        "pipeline/train/assembly/data.py:7: compares the data's kind",
        "pipeline/train/assembly/data.py:9: ' (data.kind=dpo)'",
        "pipeline/train/assembly/data.py:9: 'Sft'",
    ]
