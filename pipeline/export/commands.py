"""`pipe export`: write a checkpoint (ours, Hugging Face or Megatron) as a TensorRT-LLM
checkpoint that `trtllm-build --checkpoint_dir DIR` consumes.

    pipe export CKPT --trtllm --output trt_ckpt --tp 2 --pp 1 --dtype bfloat16
    pipe export HF_DIR --trtllm --output trt_fp8 --fp8 --calib-data data/corpus_text_document

The output is `config.json` plus `rank{r}.safetensors` per rank (rank = pp_rank * tp + tp_rank),
written under a temporary name and renamed when complete. `--verify` then runs a plain-torch
reference forward over the written files and compares its logits with the source model's.
click is the only import at module level, so `pipe export --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

DTYPES = ("bfloat16", "float16", "float32")


@click.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--trtllm", is_flag=True, help="Write a TensorRT-LLM checkpoint (the one format).")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path))
@click.option(
    "--from",
    "from_format",
    type=click.Choice(("auto", "pipe", "hf", "megatron")),
    default="auto",
    show_default=True,
    help="What SOURCE is (auto: a config.json means Hugging Face).",
)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--moe-ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="MoE: spread experts over this many of the tp ranks (the rest split each expert).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="Weights and compute dtype (default: the dtype of Hugging Face weights, else bfloat16).",
)
@click.option(
    "--use-parallel-embedding",
    is_flag=True,
    help="Split the embedding table over tp ranks too.",
)
@click.option(
    "--embedding-sharding-dim",
    type=click.Choice(("0", "1")),
    default="0",
    show_default=True,
    help="With --use-parallel-embedding: 0 splits the vocabulary, 1 the hidden size.",
)
@click.option("--fp8", is_flag=True, help="FP8 weights and activations (per-tensor scales).")
@click.option("--fp8-kv-cache", is_flag=True, help="With --fp8: an FP8 KV cache as well.")
@click.option(
    "--fp8-exclude",
    multiple=True,
    help="Module patterns kept unquantized, e.g. 'transformer.layers.0.*' (repeatable).",
)
@click.option(
    "--fp8-lm-head",
    is_flag=True,
    help="Quantize lm_head too (by default it stays in --dtype, as TRT-LLM recommends).",
)
@click.option(
    "--calib-data",
    type=click.Path(path_type=Path),
    default=None,
    help="FP8 calibration text: a .bin/.idx prefix tokenized with the model's tokenizer.",
)
@click.option("--calib-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--calib-seq-len", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--iteration", type=int, default=None, help="pipe input: this iteration.")
@click.option(
    "--verify",
    type=click.Choice(("auto", "on", "off")),
    default="auto",
    show_default=True,
    help="Reference forward on the export vs the source (auto: when the model fits in memory).",
)
@click.option("--allow-pickle", is_flag=True, help="hf input: accept pickled .bin weights.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--no-verify-checksums", "verify_checksums", is_flag=True, default=True, flag_value=False,
    help="pipe input: skip checking each file against its recorded SHA-256 while reading.",
)  # fmt: skip
def export(source: Path, output: Path, trtllm: bool, **options: Any) -> None:
    """Export SOURCE (a pipe checkpoint, a Hugging Face directory or a Megatron torch_dist
    checkpoint) as a TensorRT-LLM checkpoint."""
    if not trtllm:
        raise click.UsageError("say which format to write: --trtllm (the one supported)")
    if output.exists() and any(output.iterdir()) and not options["overwrite"]:
        raise click.UsageError(f"{output} exists and is not empty; pass --overwrite to replace it")
    if options["fp8_kv_cache"] and not options["fp8"]:
        raise click.UsageError("--fp8-kv-cache needs --fp8")
    from pipeline.export.run import CalibrationSettings, ExportError, run_export
    from pipeline.export.trtllm_config import ExportOptions
    from pipeline.export.trtllm_layout import TrtllmMapping

    try:
        export_options = ExportOptions(
            dtype=options["dtype"],
            mapping=TrtllmMapping(tp=options["tp"], pp=options["pp"], moe_ep=options["moe_ep"]),
            use_parallel_embedding=options["use_parallel_embedding"],
            embedding_sharding_dim=int(options["embedding_sharding_dim"]),
            fp8=options["fp8"],
            fp8_kv_cache=options["fp8_kv_cache"],
            exclude_modules=(
                *(() if options["fp8_lm_head"] else ("lm_head",)),
                *options["fp8_exclude"],
            ),  # fmt: skip
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    calibration = CalibrationSettings(
        options["calib_data"], options["calib_size"], options["calib_seq_len"]
    )
    try:
        summary = run_export(
            source, output, export_options,
            from_format=options["from_format"], calibration=calibration,
            iteration=options["iteration"], allow_pickle=options["allow_pickle"],
            verify=options["verify"], overwrite=options["overwrite"], quiet=options["quiet"],
            verify_checksums=options["verify_checksums"],
        )  # fmt: skip
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(summary)


if __name__ == "__main__":
    export()
