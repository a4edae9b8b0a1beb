"""Click commands `pipe preprocess`, `pipe merge`, `pipe inspect`.

Thin on purpose: only click is imported at module level, so `pipe <cmd> --help` stays instant.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click


class _ListOptionsCommand(click.Command):
    """Lets an option take several values after one flag, as argparse's nargs='+'
    (`--json-keys text title`, a shell-expanded `--input part-*`), by rewriting it into repeated
    flags before click parses."""

    list_options: tuple[str, ...] = ("--json-keys", "--input", "-i")

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rewritten: list[str] = []
        flag, waiting = None, False  # the list flag in force; True until it has a value
        for arg in args:
            if arg in self.list_options:
                if waiting:
                    rewritten.append(flag)  # a flag with no value: let click report it
                flag, waiting = arg, True
            elif flag and not arg.startswith("-"):
                rewritten += [flag, arg]
                waiting = False
            else:
                if waiting:
                    rewritten.append(flag)
                flag, waiting = None, False
                rewritten.append(arg)
        if waiting:
            rewritten.append(flag)
        return super().parse_args(ctx, rewritten)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Show the toolkit's own errors as one clean line (`Error: file:line: problem`)."""
    from pipeline.data.indexed import IndexFormatError
    from pipeline.preprocess.inputs import InputError
    from pipeline.preprocess.merge import MergeError
    from pipeline.preprocess.runner import PreprocessError
    from pipeline.preprocess.shards import ShardError
    from pipeline.tokenizer.chat_template import ChatTemplateError
    from pipeline.tokenizer.tokenizer import TokenizerError

    try:
        yield
    except (
        PreprocessError,
        InputError,
        TokenizerError,
        MergeError,
        ShardError,
        IndexFormatError,
        ChatTemplateError,
        FileNotFoundError,
    ) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:
        click.echo("interrupted: no output was written under its final name", err=True)
        sys.exit(130)


@click.command(cls=_ListOptionsCommand)
@click.option(
    "--input",
    "-i",
    "inputs",
    multiple=True,
    required=True,
    help="Input file, glob or `datasets` directory; repeat for several. JSONL "
    "(.jsonl, .jsonl.zst, .jsonl.gz), Parquet, Arrow, JSON.",
)
@click.option(
    "--output-prefix",
    "-o",
    required=True,
    help="Writes {prefix}_{key}_document.bin/.idx per key and {prefix}.json.",
)
@click.option(
    "--tokenizer",
    "--tokenizer-model",
    "tokenizer_path",
    required=True,
    help="tokenizer.json, a SentencePiece .model, vocab.json (+ merges.txt), "
    "or a directory holding one.",
)
@click.option("--merge-file", default=None, help="GPT-2 merges.txt (default: beside vocab.json).")
@click.option(
    "--json-keys",
    multiple=True,
    default=("text",),
    show_default=True,
    help="Keys to tokenize, one output per key: --json-keys text title.",
)
@click.option("--append-eod", is_flag=True, help="Append the EOS id to every non-empty document.")
@click.option(
    "--add-special-tokens",
    "--tokenizer-hf-include-special-tokens",
    "add_special_tokens",
    is_flag=True,
    help="Apply the tokenizer's post-processing (e.g. BOS), as Megatron's "
    "--tokenizer-hf-include-special-tokens.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=os.cpu_count() or 1,
    show_default=True,
    help="Encoding workers: processes forked after the tokenizer load (gigatoken on Linux), "
    "else threads.",
)
@click.option(
    "--skip-bad-lines",
    is_flag=True,
    help="Skip malformed lines (reported with file:line) instead of stopping.",
)
@click.option("--overwrite", is_flag=True, help="Replace existing outputs.")
@click.option(
    "--tokenizer-engine",
    type=click.Choice(["auto", "gigatoken", "tokenizers"]),
    default="auto",
    show_default=True,
    help="auto: gigatoken where its self-test at load proves it identical to the reference "
    "library; tokenizers: the reference only (sentencepiece for a .model).",
)
@click.option(
    "--record-sources",
    is_flag=True,
    help="Write {prefix}_{key}_document.sources: each document's input file and line (or "
    "row), shown by `pipe inspect --show`.",
)
@click.option(
    "--log-interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between progress lines when stderr is not a terminal.",
)
@click.option(
    "--num-shards",
    type=click.IntRange(min=1),
    default=None,
    help="Split the run into N shards; this process runs --shard-index I and writes "
    "{prefix}.shard-I-of-N_*. Default: from torchrun (RANK, WORLD_SIZE) or a Slurm array "
    "(SLURM_ARRAY_TASK_ID, _COUNT, _MIN) when present. Join with `pipe merge --shards PREFIX`.",
)
@click.option(
    "--shard-index", type=click.IntRange(min=0), default=None, help="This shard (0..N-1)."
)
@click.option(
    "--chat",
    is_flag=True,
    help="Conversations (messages, ShareGPT conversations or prompt/completion) rendered by the "
    "chat template into {prefix}_messages_document and a uint8 loss mask (1 on the assistant's "
    "tokens) {prefix}_messages_loss_mask_document.",
)
@click.option(
    "--preference",
    is_flag=True,
    help="Preference pairs ({prompt | messages, chosen, rejected}): each side rendered as --chat "
    "renders a conversation, into {prefix}_chosen_document, {prefix}_rejected_document and their "
    "loss masks {prefix}_chosen_loss_mask_document, {prefix}_rejected_loss_mask_document (pair "
    "i is document i of each), for `pipe train --dpo`.",
)
@click.option(
    "--chat-template",
    "chat_template",
    default=None,
    type=click.Path(dir_okay=False),
    help="With --chat or --preference: a Jinja chat template file instead of the tokenizer's own.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.pass_context
def preprocess(
    ctx,
    inputs,
    output_prefix,
    tokenizer_path,
    merge_file,
    json_keys,
    append_eod,
    add_special_tokens,
    workers,
    skip_bad_lines,
    overwrite,
    tokenizer_engine,
    record_sources,
    log_interval,
    num_shards,
    shard_index,
    chat,
    preference,
    chat_template,
    quiet,
) -> None:
    """Tokenize raw text into Megatron-compatible .bin/.idx token shards.

    \b
    pipe preprocess --input data.jsonl.zst --tokenizer llama3/ \\
        --output-prefix out/corpus --append-eod --workers 8
    pipe preprocess --chat --input chat.jsonl --tokenizer llama3/ --output-prefix out/sft
    pipe preprocess --preference --input pairs.jsonl --tokenizer llama3/ --output-prefix out/dpo
    """
    _check_chat_flags(ctx, chat, preference, chat_template, append_eod, add_special_tokens)
    with _user_errors():
        from pipeline.preprocess.runner import PreprocessConfig
        from pipeline.preprocess.shards import resolve_shard

        shard = resolve_shard(num_shards, shard_index)  # before the tokenizer: fail fast
        setup = None
        if chat or preference:
            from pipeline.preprocess.chat import load_chat_setup

            setup = load_chat_setup(tokenizer_path, chat_template)
        tokenizer = _open_tokenizer(
            tokenizer_path, merge_file, add_special_tokens, tokenizer_engine, quiet
        )
        config = PreprocessConfig(
            inputs=list(inputs),
            output_prefix=output_prefix,
            json_keys=tuple(json_keys),
            append_eod=append_eod,
            workers=workers,
            skip_bad_lines=skip_bad_lines,
            overwrite=overwrite,
            record_sources=record_sources,
            log_interval=log_interval,
            show_progress=not quiet,
            shard=shard,
            chat=setup,
            preference=preference,
        )
        _run_and_summarise(config, tokenizer)


def _open_tokenizer(path, merge_file, add_special_tokens, engine, quiet: bool):
    """The tokenizer the run encodes with, and (unless `quiet`) one line saying which."""
    from pipeline.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(
        path, merge_file=merge_file, add_special_tokens=add_special_tokens, engine=engine
    )
    if not quiet:
        note = f" ({tokenizer.engine_note})" if tokenizer.engine_note else ""
        click.echo(
            f"tokenizer {tokenizer.files[0]}: vocab {tokenizer.vocab_size:,}, "
            f"eod {tokenizer.eod}, engine {tokenizer.engine}{note}",
            err=True,
        )
    return tokenizer


def _run_and_summarise(config, tokenizer) -> None:
    """Preprocess as `config` says and print the summary (with progress on, first the chat
    template in use)."""
    from pipeline.preprocess.runner import format_summary
    from pipeline.preprocess.runner import preprocess as run

    if config.chat is not None and config.show_progress:
        origin, rule = config.chat.origin, config.chat.rule
        click.echo(f"chat template {origin}: loss mask by rule {rule}", err=True)
    for line in format_summary(run(config, tokenizer)):
        click.echo(line)


def _check_chat_flags(ctx, chat, preference, chat_template, append_eod, add_special_tokens):
    """--chat (and --preference) render each conversation as transformers does and write fixed
    outputs: the flags that would change that are refused, as is asking for both."""
    if chat and preference:
        raise click.UsageError("--chat and --preference: choose one")
    chat = chat or preference
    if chat_template is not None and not chat:
        raise click.UsageError("--chat-template goes with --chat or --preference")
    if not chat:
        return
    source = ctx.get_parameter_source("json_keys")
    if source is not None and source.name == "COMMANDLINE":
        raise click.UsageError(
            "--chat reads messages/conversations/prompt+completion: drop --json-keys"
        )
    if append_eod or add_special_tokens:
        raise click.UsageError(
            "--chat encodes the rendered conversation as it stands (its template writes the "
            "special tokens): drop --append-eod and --add-special-tokens"
        )


class _MergeCommand(_ListOptionsCommand):
    list_options = ("--input", "-i", "--shards")


@click.command(cls=_MergeCommand)
@click.option(
    "--input",
    "-i",
    "inputs",
    multiple=True,
    help="Dataset prefix, .bin/.idx path, glob or directory; repeat for several. "
    "Merged in the order given (a directory: sorted names, as Megatron).",
)
@click.option(
    "--shards",
    multiple=True,
    help="The --output-prefix of a sharded `pipe preprocess` run (or its shard files): checks "
    "that all N shards finished and agree, then writes {prefix}_{key}_document.bin/.idx and "
    "{prefix}.json as one machine's run would.",
)
@click.option(
    "--output-prefix",
    "-o",
    default=None,
    help="Writes {prefix}.bin/.idx (with --shards: {prefix}_{key}_document.*; default the "
    "shards' prefix).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
def merge(inputs, shards, output_prefix, overwrite) -> None:
    """Concatenate .bin/.idx datasets of one dtype into one (as Megatron's merge_datasets.py),
    or join the shards of a sharded `pipe preprocess` run.

    \b
    pipe merge --input out/a_text_document out/b_text_document -o out/ab_text_document
    pipe merge --shards out/corpus
    """
    if bool(inputs) == bool(shards):
        raise click.UsageError("give either --input (datasets) or --shards (a sharded run)")
    if inputs and output_prefix is None:
        raise click.UsageError("--input needs --output-prefix")
    with _user_errors():
        if shards:
            _merge_shards(list(shards), output_prefix, overwrite)
            return
        from pipeline.preprocess.merge import merge as run

        summary = run(list(inputs), output_prefix, overwrite=overwrite)
        click.echo(
            f"merged {len(summary.inputs)} datasets into {summary.output_prefix}.bin/.idx "
            f"({summary.dtype}, {summary.documents:,} documents, "
            f"{summary.sequences:,} sequences, {summary.tokens:,} tokens)"
        )


def _merge_shards(shards: list[str], output_prefix: str | None, overwrite: bool) -> None:
    from pipeline.preprocess.shard_merge import merge_shards

    summary = merge_shards(shards, output_prefix, overwrite=overwrite)
    click.echo(f"merged {summary.count} shards into {summary.output_prefix}")
    for out in summary.outputs.values():
        click.echo(
            f"wrote {out['prefix']}.bin/.idx ({out['dtype']}, {out['documents']:,} documents, "
            f"{out['sequences']:,} sequences, {out['tokens']:,} tokens)"
        )
    click.echo(f"manifest {summary.manifest}")


@click.command()
@click.argument("prefix", required=False)
@click.option(
    "--show",
    type=click.IntRange(min=0),
    default=0,
    help="Decode and print the first N documents of PREFIX (with their input file and line "
    "when it was preprocessed with --record-sources).",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    help="Tokenizer for --show (default: the one recorded in the manifest).",
)
@click.option(
    "--data",
    default=None,
    help='A training blend instead of PREFIX: "0.7 a_text_document 0.3 b_text_document" or '
    "unweighted prefixes. Shows what a run will read from each dataset.",
)
@click.option("--seq-length", type=click.IntRange(min=1), help="Sequence length (with --data).")
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=None,
    help="Training samples the run reads, i.e. iterations x global batch (with --data).",
)
@click.option(
    "--split",
    default="969,30,1",
    show_default=True,
    help="Train/valid/test split of each dataset (with --data), as --split in training.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect(prefix, show, tokenizer_path, data, seq_length, samples, split, as_json) -> None:
    """What a .bin/.idx dataset holds (counts, dtype, lengths, provenance), or with --data what
    a training run will read from each dataset of a blend.

    \b
    pipe inspect out/corpus_text_document --show 2
    pipe inspect --data "0.7 out/a_text_document 0.3 out/b_text_document" \\
        --seq-length 4096 --samples 128000
    """
    with _user_errors():
        if data is not None:
            _inspect_blend(prefix, data, seq_length, samples, split, as_json)
            return
        if prefix is None:
            raise click.UsageError("give a dataset PREFIX, or --data with a blend")
        from pipeline.preprocess.inspect import (
            decoded_documents,
            describe,
            document_sources,
            format_description,
        )

        info = describe(prefix)
        if as_json:
            click.echo(json.dumps(info, indent=2))
        else:
            click.echo("\n".join(format_description(info)))
        if show:
            tokenizer = _tokenizer_for_show(tokenizer_path, info)
            sources = document_sources(prefix, info, show)
            for i, text in enumerate(decoded_documents(prefix, tokenizer, show)):
                where = f" (from {sources[i]})" if sources else ""
                click.echo(f"--- document {i}{where} ---\n{text}")


def _inspect_blend(prefix, data, seq_length, samples, split, as_json) -> None:
    if prefix is not None:
        raise click.UsageError("give either a dataset PREFIX or --data, not both")
    if seq_length is None:
        raise click.UsageError("--data needs --seq-length")
    from pipeline.data.blend_description import describe_blend, format_blend_description
    from pipeline.data.blend_spec import check_compatible, parse_blend

    try:
        blend = parse_blend(data)
        rows = describe_blend(blend, seq_length, samples, split=split)
    except ValueError as e:  # a bad weight, split or prefix in what the user typed
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo("\n".join(format_blend_description(rows, seq_length)))
    try:
        check_compatible(blend.prefixes)
    except ValueError as e:
        click.echo(f"warning: training would refuse this blend: {e}", err=True)


def _tokenizer_for_show(path: str | None, info: dict):
    from pipeline.tokenizer.tokenizer import load_tokenizer

    if path is None:
        files = info.get("manifest", {}).get("tokenizer", {}).get("files", [])
        if not files:
            raise click.UsageError("--show needs --tokenizer (no manifest names one)")
        path = files[0]["path"]
    return load_tokenizer(path, engine="tokenizers")
