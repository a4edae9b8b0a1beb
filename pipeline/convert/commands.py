"""`pipe convert`: move a model between our checkpoints, Hugging Face and Megatron, or re-lay
out one of ours.

    pipe convert CKPT --to hf --output DIR [--dtype bf16] [--shard-size 5GB]
    pipe convert DIR --from hf --output CKPT             (then: pipe train --load CKPT --finetune)
    pipe convert DIR --from megatron --output CKPT
    pipe convert CKPT --tp 4 --pp 2 --output CKPT2       (offline re-layout)

Every path streams: a reader (`TensorSource`) gives one full tensor at a time and a writer
consumes it, so peak memory stays near the largest tensor. Outputs are written under a
temporary name and renamed when complete. `--verify` then checks the result: bit-identical
tensors for pipe outputs, the same logits as transformers for Hugging Face ones.
click is the only import at module level, so `pipe convert --help` stays instant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

FORMATS_IN = ("pipe", "hf", "megatron")
FORMATS_OUT = ("pipe", "hf")
DTYPES = ("bf16", "fp16", "fp32")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """Bytes from `5GB`, `500MB`, `1e9`-free plain integers (decimal units, as transformers)."""
    match = _SIZE.match(text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a size such as 5GB or 500MB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper() if unit else None])


def parse_verify(text: str) -> tuple[str, int | None]:
    """`auto`, `on`, `off` or `layers=N` -> (mode, layers)."""
    text = text.strip().lower()
    if text in ("auto", "on", "off"):
        return text, None
    match = re.fullmatch(r"layers=(\d+)", text)
    if match and int(match.group(1)) > 0:
        return "on", int(match.group(1))
    raise click.BadParameter(f"{text!r}: use auto, on, off or layers=N")


@click.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(path_type=Path),
    help="Output directory (a checkpoint save dir, or a Hugging Face model dir).",
)
@click.option(
    "--from",
    "from_format",
    type=click.Choice(FORMATS_IN),
    default="pipe",
    show_default=True,
    help="What SOURCE is.",
)
@click.option(
    "--to",
    "to_format",
    type=click.Choice(FORMATS_OUT),
    default="pipe",
    show_default=True,
    help="What to write.",
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="pipe output: cut tensors for this tensor-parallel degree.",
)
@click.option(
    "--pp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="pipe output: pipeline-parallel degree recorded for the target.",
)
@click.option(
    "--ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="pipe output: cut experts for this expert-parallel degree.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="Tensor dtype written (default for hf: the dtype of weights that came from Hugging "
    "Face, else bf16; unchanged for pipe).",
)
@click.option(
    "--shard-size", default="5GB", show_default=True, help="hf output: largest safetensors file."
)
@click.option("--iteration", type=int, default=None, help="pipe input: this iteration.")
@click.option(
    "--verify",
    "verify",
    default="auto",
    show_default=True,
    help="auto (when transformers is installed and the model fits), on, off, "
    "or layers=N (compare logits of the first N layers only).",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(exists=True, path_type=Path),
    help="hf output: copy tokenizer files from here (default: the checkpoint's "
    "recorded tokenizer, when its files still match).",
)
@click.option(
    "--flavor",
    default=None,
    help="megatron input: the model flavor, when heads cannot be read from the files.",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="hf input: accept pickled .bin/.pt weights (loaded with weights_only=True).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--no-verify-checksums",
    "verify_checksums",
    is_flag=True,
    default=True,
    flag_value=False,
    help="pipe input: skip checking each file against its recorded SHA-256 while reading.",
)
def convert(source: Path, output: Path, from_format: str, to_format: str, **options: Any) -> None:
    """Convert SOURCE (a pipe checkpoint, a Hugging Face directory, or a Megatron torch_dist
    checkpoint) to a pipe checkpoint or a Hugging Face model directory."""
    mode, layers = parse_verify(options.pop("verify"))
    shard_bytes = parse_size(options.pop("shard_size"))
    if output.exists() and any(output.iterdir()) and not options["overwrite"]:
        raise click.UsageError(f"{output} exists and is not empty; pass --overwrite to replace it")
    if to_format == "hf" and (options["tp"], options["pp"], options["ep"]) != (1, 1, 1):
        raise click.UsageError("--tp/--pp/--ep lay out pipe checkpoints; --to hf has no layout")
    from pipeline.convert.run import ConversionError, run_conversion

    try:
        summary = run_conversion(
            source,
            output,
            from_format,
            to_format,
            shard_bytes=shard_bytes,
            verify=mode,
            verify_layers=layers,
            **options,
        )
    except ConversionError as e:
        raise click.ClickException(str(e)) from None
    click.echo(summary)


if __name__ == "__main__":
    convert()
