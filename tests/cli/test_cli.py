"""The `pipe` command line: every command's help works, and help never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipeline.cli import COMMANDS, cli


def test_root_help_lists_every_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help(name):
    """Lazy loading hides import errors until a command runs; this imports each one."""
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output and name in result.output


@pytest.mark.parametrize("args", [["--help"], *[[name, "--help"] for name in sorted(COMMANDS)]])
def test_help_does_not_import_torch(args):
    code = (
        "import sys\n"
        "from pipeline.cli import cli\n"
        f"try:\n    cli({args!r}, prog_name='pipe')\n"
        "except SystemExit:\n    pass\n"
        "heavy = ('torch', 'datasets', 'tokenizers', 'gigatoken')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_console_script_and_module_entry_points():
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("pipe, version")


def test_json_keys_takes_several_values(tmp_path, tiny_tokenizer_dir):
    from tests.builders import write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a", "title": "b", "body": "c"}])
    result = CliRunner().invoke(
        cli,
        [
            "preprocess",
            "--json-keys",
            "text",
            "title",
            "body",
            "--input",
            str(src),
            "--tokenizer",
            str(tiny_tokenizer_dir),
            "--output-prefix",
            str(tmp_path / "o"),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    for key in ("text", "title", "body"):
        assert (tmp_path / f"o_{key}_document.idx").exists()
    result = CliRunner().invoke(cli, ["preprocess", "--input", str(src), "--json-keys"])
    assert result.exit_code == 2 and "requires an argument" in result.output
