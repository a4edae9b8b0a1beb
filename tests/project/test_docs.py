"""The repository stands alone: its files cite only documents inside it (docs/), every cited
section exists, and the package import order that docs/architecture.md states holds.

Tests may still read the shared test data beside the checkout (`tests.builders.SHARED_DATA`):
that is data, not a document."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.builders import ROOT

THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Pointers at what sits outside a user's clone: design notes, format specs, the test data.
OUTSIDE_REFERENCES = [
    re.compile(r"\.\./shared"),
    re.compile(r"shared/specs"),
    re.compile(r"DESIGN(\.md| principle)"),
    re.compile(r"megatron_data\.md|style[_ ]anchors", re.IGNORECASE),
    re.compile(r"§"),  # section numbers of those specs; docs/ is cited by section name
    # The format spec's own name, in any path (this repository's is docs/file_layouts.md).
    re.compile(r"formats\.md"),
]
DOC_CITATION = re.compile(r'docs/([\w-]+\.md)(?:, "([^"]+)")?')


def tracked_text_files() -> dict[str, str]:
    """Every file git tracks (or would track: not ignored), read as text; binary files skipped."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    texts = {}
    for name in listed:
        try:
            texts[name] = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
    return texts


def test_no_file_points_at_documents_outside_the_repository() -> None:
    found = []
    for name, text in tracked_text_files().items():
        if name == THIS:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(pattern.search(line) for pattern in OUTSIDE_REFERENCES):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def _headings(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("#").strip().replace("`", "") for line in lines if line.startswith("#")]


def test_cited_docs_and_sections_exist() -> None:
    """`docs/file_layouts.md, "Rank files"` in a comment names a file and a heading that exist."""
    missing = []
    for name, text in tracked_text_files().items():
        for match in DOC_CITATION.finditer(text):
            doc, section = ROOT / "docs" / match.group(1), match.group(2)
            if not doc.is_file():
                missing.append(f"{name}: {match.group(0)} (no such file)")
            elif section is not None and section not in _headings(doc):
                missing.append(f"{name}: {match.group(0)} (no such heading)")
    assert not missing, "\n".join(missing)


# docs/architecture.md, "Rules": a package imports only from lower layers.
LAYERS = {
    "common": 0,
    "data": 1,
    "checkpoint": 1,
    "tokenizer": 1,
    "preprocess": 2,
    "examples": 2,
    "core": 3,
    "weights": 4,
    "train": 5,
    "convert": 6,
    "export": 6,
    "serve": 6,
}
# One way across: GRPO's rollouts run pipe's inference engine in the training processes, or
# on a running server that takes the new weights, so `train` may import the engine's own
# modules of `serve`, its weight client and, for multi-turn rollouts with tools, its tool-call
# parsers (the server, routes and loading stay out of reach).
# What a `train` module may take from `serve`: the engine room, the weight client, the parsers.
SERVE_FOR_TRAINING = {("engine",), ("http", "weight_client"), ("http", "tool_parsers")}
# Above every layer: the command group and the package's own entry points.
ENTRY_POINTS = {"cli", "__main__", "__init__"}
# Modules that turn a command line into a run: only the same package's commands import them.
COMMAND_MODULES = {"commands", "run", "plot_command"}


def _imported_modules(path: Path) -> set[str]:
    """Dotted names of pipeline modules imported anywhere in `path`, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [
                f"{node.module}.{alias.name}" for alias in node.names if alias.name[0] != "_"
            ]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("pipeline."))
    return found


def _pipeline_imports(path: Path, package: str = "") -> set[str]:
    """Top-level pipeline packages imported anywhere in `path`, lazy imports included, less the
    serve modules a `train` module may take (SERVE_FOR_TRAINING)."""
    found = set()
    for name in _imported_modules(path):
        parts = name.split(".")
        rooms = {tuple(parts[2:3]), tuple(parts[2:4])}
        if not (package == "train" and parts[1] == "serve" and rooms & SERVE_FOR_TRAINING):
            found.add(parts[1])
    return found


def _package_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else path.stem


def _packages_without_a_layer(root: Path) -> list[str]:
    """Top-level packages and modules under `root` that the layer table does not place."""
    names = {_package_of(path, root) for path in root.rglob("*.py")}
    return sorted(names - set(LAYERS) - ENTRY_POINTS)


def _layer_violations(root: Path) -> list[str]:
    wrong = []
    for path in sorted(root.rglob("*.py")):
        package = _package_of(path, root)
        if package not in LAYERS:
            continue
        for target in _pipeline_imports(path, package) - {package}:
            if LAYERS.get(target, len(LAYERS)) >= LAYERS[package]:
                where = path.relative_to(root.parent)
                wrong.append(f"{where} ({package}) imports pipeline.{target}")
    return wrong


def _command_module_imports(root: Path) -> list[str]:
    """Imports of another package's command module (`pipeline.convert.run` from export...)."""
    wrong = []
    for path in sorted(root.rglob("*.py")):
        package = _package_of(path, root)
        if package in ENTRY_POINTS:
            continue
        for name in _imported_modules(path):
            parts = name.split(".")
            if len(parts) == 3 and parts[2] in COMMAND_MODULES and parts[1] != package:
                wrong.append(f"{path.relative_to(root.parent)} imports {name}")
    return wrong


def test_packages_import_only_lower_layers() -> None:
    wrong = _layer_violations(ROOT / "pipeline")
    assert not wrong, "\n".join(wrong)


def test_every_package_has_a_layer() -> None:
    """A new package must be placed in the table above (and in docs/architecture.md)."""
    unplaced = _packages_without_a_layer(ROOT / "pipeline")
    assert not unplaced, f"packages missing from LAYERS and docs/architecture.md: {unplaced}"


def test_no_package_imports_another_packages_command_module() -> None:
    wrong = _command_module_imports(ROOT / "pipeline")
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_an_unplaced_package_and_a_wrong_import(tmp_path: Path) -> None:
    """The rules above fail on a tree that breaks them (so they are not vacuous)."""
    root = tmp_path / "pipeline"
    (root / "newpkg").mkdir(parents=True)
    (root / "newpkg" / "__init__.py").write_text("")
    (root / "data").mkdir()
    (root / "data" / "x.py").write_text("from pipeline.train.config.schema import TrainConfig\n")
    (root / "export").mkdir()
    (root / "export" / "y.py").write_text("from pipeline.convert.run import open_source\n")
    assert _packages_without_a_layer(root) == ["newpkg"]
    assert _layer_violations(root) == [
        "pipeline/data/x.py (data) imports pipeline.train",
        "pipeline/export/y.py (export) imports pipeline.convert",  # commands share one layer
    ]
    assert _command_module_imports(root) == ["pipeline/export/y.py imports pipeline.convert.run"]


def test_architecture_doc_lists_every_package_in_layer_order() -> None:
    """docs/architecture.md's import-order list names each package of the table, layer by layer
    (the packages of a layer are the names before its parenthesis)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rules = text[text.index("**Import order.**") :]
    layers = re.findall(r"^\s+(\d+)\. (.+)$", rules, flags=re.MULTILINE)
    documented = {
        name: int(number) - 1
        for number, line in layers
        for name in re.findall(r"`(\w+)`", line.split("(")[0])
    }
    assert documented == LAYERS
