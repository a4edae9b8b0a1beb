"""The `pipe` command line: a click group whose subcommands are imported only when run.

`pipe --help` lists commands from the static table below without importing them, and each
command module keeps its heavy imports (torch, datasets, tokenizers) inside its callback, so help
is instant and never imports torch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import click

from pipeline import __version__

# name -> (module:attribute, one-line help shown by `pipe --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "plot": (
        "pipeline.train.plot_command:plot",
        "Plot loss, lr, grad norm and tokens/s of one or more runs.",
    ),
    "preprocess": (
        "pipeline.preprocess.commands:preprocess",
        "Tokenize JSONL/Parquet/Arrow text into Megatron .bin/.idx token shards.",
    ),
    "merge": (
        "pipeline.preprocess.commands:merge",
        "Concatenate .bin/.idx datasets of one dtype into one.",
    ),
    "convert": (
        "pipeline.convert.commands:convert",
        "Convert checkpoints: to/from Hugging Face, from Megatron, between layouts.",
    ),
    "export": (
        "pipeline.export.commands:export",
        "Export a checkpoint for TensorRT-LLM, vLLM or SGLang (bf16/fp16, FP8).",
    ),
    "checkpoint": (
        "pipeline.checkpoint.commands:checkpoint",
        "Verify checkpoints: complete, every file intact.",
    ),
    "inspect": (
        "pipeline.preprocess.commands:inspect",
        "Show what a .bin/.idx dataset holds, or what a run reads from a blend.",
    ),
    "generate": (
        "pipeline.serve.commands:generate",
        "Continue a prompt with a checkpoint's model, streaming the text.",
    ),
    "serve": (
        "pipeline.serve.commands:serve",
        "Serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching).",
    ),
    "eval": (
        "pipeline.serve.eval_command:evaluate",
        "Score a checkpoint with lm-evaluation-harness tasks, served by pipe's engine.",
    ),
    "train": (
        "pipeline.train.commands:train",
        "Train a Llama-style dense or MoE model from a recipe (--dry-run to size it first).",
    ),
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that subcommand is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, attribute = COMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module_name), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pipe")
def cli() -> None:
    """pipe: the life of an LLM pre-training run, from raw text to trained checkpoints.

    \b
    pipe preprocess  raw text -> Megatron .bin/.idx token shards
    pipe merge       several shards -> one
    pipe inspect     what a shard holds
    pipe train       train a model from a recipe on preprocessed data
    pipe checkpoint  verify a checkpoint
    pipe convert     checkpoints <-> Hugging Face, from Megatron, between layouts
    pipe export      a checkpoint -> TensorRT-LLM, vLLM, SGLang (Hugging Face, FP8)
    pipe plot        curves of one or more runs
    pipe generate    text from a checkpoint, at the terminal
    pipe serve       text from a checkpoint, over an OpenAI-compatible HTTP API
    pipe eval        lm-evaluation-harness scores of a checkpoint
    """


# Commands whose work is finished, every output closed and renamed, when they return. The
# process then ends without the interpreter's teardown: for `pipe preprocess` that teardown is
# the tokenizer engine freeing its caches, 0.1-0.2 s of a run that takes seconds.
EXIT_AT_ONCE = frozenset({"preprocess", "merge"})


def main() -> None:
    """Console-script entry point."""
    try:
        cli(prog_name="pipe")
    except SystemExit as done:
        if done.code in (None, 0) and sys.argv[1:2] and sys.argv[1] in EXIT_AT_ONCE:
            _exit_now()
        raise


def _exit_now() -> None:
    """End the process with status 0 after flushing what Python still buffers."""
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A reader that went away, or a stream already closed, does not undo the success.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)
