"""The repository stands alone: its files cite only documents inside it (docs/), every cited
section exists, and the package import order that docs/architecture.md states holds.

Tests may still read test data from ../shared/data: that is data, not a document."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Pointers at the design notes and format specs that sit outside a user's clone.
OUTSIDE_REFERENCES = [
    re.compile(r"\.\./shared(?!/data)"),
    re.compile(r"shared/specs"),
    re.compile(r"DESIGN(\.md| principle)"),
    re.compile(r"megatron_data\.md|style[_ ]anchors", re.IGNORECASE),
    re.compile(r"§"),  # section numbers of those specs; docs/ is cited by section name
]
BARE_FORMATS_MD = re.compile(r"(?<!docs/)\bformats\.md")
DOC_CITATION = re.compile(r'docs/([\w-]+\.md)(?:, "([^"]+)")?')


def tracked_text_files() -> dict[str, str]:
    """Every file git tracks (or would track: not ignored), read as text; binary files skipped."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
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
        patterns = list(OUTSIDE_REFERENCES)
        if not name.startswith("docs/"):  # docs/ link each other by bare name
            patterns.append(BARE_FORMATS_MD)
        for number, line in enumerate(text.splitlines(), 1):
            if any(pattern.search(line) for pattern in patterns):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def _headings(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("#").strip().replace("`", "") for line in lines if line.startswith("#")]


def test_cited_docs_and_sections_exist() -> None:
    """`docs/formats.md, "Rank files"` in a comment names a file and a heading that exist."""
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
    "quiet": 0,
    "data": 1,
    "checkpoint": 1,
    "preprocess": 2,
    "examples": 2,
    "core": 3,
    "train": 4,
    "convert": 4,
    "export": 5,
}


def _pipeline_imports(path: Path) -> set[str]:
    """Top-level pipeline packages imported anywhere in `path`, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n.split(".")[1] for n in names if n.startswith("pipeline."))
    return found


def test_packages_import_only_lower_layers() -> None:
    wrong = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        parts = path.relative_to(ROOT / "pipeline").parts
        package = parts[0] if len(parts) > 1 else path.stem
        if package not in LAYERS:  # cli.py, __main__.py, __init__.py sit above everything
            continue
        for target in _pipeline_imports(path) - {package}:
            if LAYERS.get(target, len(LAYERS)) >= LAYERS[package]:
                wrong.append(f"{path.relative_to(ROOT)} ({package}) imports pipeline.{target}")
    assert not wrong, "\n".join(wrong)
