"""The documentation holds together: README.md stays a front page, every relative link in it and
in docs/ resolves (the file exists; a `#anchor` names a heading of that file, as GitHub spells
it), every page of docs/ is reachable from the README, and every long option of every `pipe`
command is named on that command's page (docs/preprocess.md, docs/train.md, ...)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click

from pipeline.cli import COMMANDS
from tests.builders import ROOT

README_MAX_LINES = 300

# Each `pipe` command and the page that documents it (its `--help` options all named there).
COMMAND_PAGES = {
    "preprocess": "docs/preprocess.md",
    "merge": "docs/preprocess.md",
    "inspect": "docs/preprocess.md",
    "train": "docs/train.md",
    "plot": "docs/train.md",
    "checkpoint": "docs/train.md",
    "convert": "docs/convert.md",
    "export": "docs/export.md",
    "generate": "docs/serve.md",
    "serve": "docs/serve.md",
    "eval": "docs/serve.md",
}

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto: ...


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of `text` outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered (links and code marks dropped),
    lower case, every character but letters, digits, `_`, `-` and spaces removed, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings give, repeated slugs numbered as GitHub does."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of each relative link in a Markdown file, code left out."""
    links = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            target = match.group(1)
            if not EXTERNAL.match(target):
                links.append((number, target))
    return links


def broken_links(path: Path, root: Path) -> list[str]:
    """`file:line: target (why)` for each relative link of `path` that does not resolve."""
    broken = []
    where = path.relative_to(root).as_posix()
    for number, target in relative_links(path):
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if not linked.exists():
            broken.append(f"{where}:{number}: {target} (no such file)")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{where}:{number}: {target} (no heading #{anchor} there)")
    return broken


def documentation(root: Path) -> list[Path]:
    """The Markdown files a reader is sent through: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def long_options(command: click.Command) -> list[str]:
    """Every `--name` a command (and, for a group, each of its subcommands) takes."""
    if isinstance(command, click.Group):
        return [name for sub in command.commands.values() for name in long_options(sub)]
    names = []
    for param in command.params:
        if isinstance(param, click.Option):
            names += [o for o in [*param.opts, *param.secondary_opts] if o.startswith("--")]
    return names


def missing_options(command: click.Command, page_text: str) -> list[str]:
    """The long options of `command` that `page_text` never names (`--lora` is not found in
    `--lora-base`: a name must stand alone)."""
    return [
        name
        for name in long_options(command)
        if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", page_text)
    ]


def _command(name: str) -> click.Command:
    module, attribute = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module), attribute)


def test_readme_is_a_front_page() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}"


def test_every_relative_link_resolves() -> None:
    broken = [problem for path in documentation(ROOT) for problem in broken_links(path, ROOT)]
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for _, t in relative_links(readme)}
    orphans = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link to: {orphans}"


def test_every_command_has_a_page() -> None:
    assert set(COMMAND_PAGES) == set(COMMANDS), "add the new command's page to COMMAND_PAGES"
    assert all((ROOT / page).is_file() for page in COMMAND_PAGES.values())


def test_every_option_is_named_on_its_commands_page() -> None:
    missing = []
    for name, page in sorted(COMMAND_PAGES.items()):
        text = (ROOT / page).read_text(encoding="utf-8")
        for option in missing_options(_command(name), text):
            missing.append(f"pipe {name} {option} (in {page})")
    assert not missing, "options no page names:\n" + "\n".join(missing)


def test_the_checks_catch_broken_links_and_missing_options(tmp_path: Path) -> None:
    """The checks above fail on documents that break them (so they are not vacuous)."""
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "page.md").write_text(
        "# A page\n\n## Will it fit? `--dry-run --gpu`\n\n## Twice\n\n## Twice\n"
    )
    (tmp_path / "README.md").write_text(
        "# Front\n\n"
        "[ok](guide/page.md) [ok](guide/page.md#will-it-fit---dry-run---gpu) [ok](#front)\n"
        "[ok](guide/page.md#twice-1) [web](https://example.com/x.md) `[code](nowhere.md)`\n"
        "[gone](guide/missing.md)\n"
        "[no heading](guide/page.md#will-it-fit) [no self heading](#back)\n"
        "```\n[in a fence](fenced.md)\n```\n"
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:5: guide/missing.md (no such file)",
        "README.md:6: guide/page.md#will-it-fit (no heading #will-it-fit there)",
        "README.md:6: #back (no heading #back there)",
    ]

    @click.command()
    @click.option("--lora", is_flag=True)
    @click.option("--lora-base")
    @click.option("--cache/--no-cache", default=True)
    def command(lora: bool, lora_base: str, cache: bool) -> None:
        """A command with options that are prefixes of each other."""

    assert missing_options(command, "`--lora-base DIR` and `--no-cache`") == ["--lora", "--cache"]
    assert missing_options(command, "--lora, --lora-base, --cache/--no-cache") == []
