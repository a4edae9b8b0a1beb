"""`pipe export`: write a checkpoint (ours, Hugging Face or Megatron) for a serving engine.

    pipe export CKPT --trtllm --output out/model [--dtype bfloat16]     # trtllm-serve out/model
    pipe export HF_DIR --vllm --output out/fp8 --fp8 --calib-data data/corpus_text_document
    pipe export CKPT --trtllm --trtllm-format legacy --output trt_ckpt --tp 2   # TRT-LLM <= 1.3

`--trtllm`, `--vllm` and `--sglang` write the same Hugging Face checkpoint (FP8: ModelOpt's
format), which each engine loads directly; `--trtllm-format legacy` writes the rank files of
TensorRT-LLM's removed TensorRT backend (`trtllm-build --checkpoint_dir DIR`). Outputs are
written under a temporary name and renamed when complete, then verified (`--verify`). click is
the only import at module level, so `pipe export --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from pipeline.export.options import ExportOptions

DTYPES = ("bfloat16", "float16", "float32")


@click.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--peft",
    is_flag=True,
    help="A LoRA checkpoint's adapters as Hugging Face PEFT files (peft, vLLM's --lora-modules).",
)
@click.option(
    "--base-model",
    default=None,
    metavar="HF_DIR_OR_ID",
    help="--peft: the base peft loads the adapters onto (default: the Hugging Face directory "
    "the LoRA run's base came from).",
)
@click.option("--trtllm", is_flag=True, help="For TensorRT-LLM (a Hugging Face checkpoint).")
@click.option("--vllm", is_flag=True, help="For vLLM (the same Hugging Face checkpoint).")
@click.option("--sglang", is_flag=True, help="For SGLang (the same Hugging Face checkpoint).")
@click.option(
    "--trtllm-format",
    type=click.Choice(("hf", "legacy")),
    default="hf",
    show_default=True,
    help="legacy: rank{r}.safetensors for trtllm-build (TensorRT-LLM up to 1.3; frozen).",
)
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path))
@click.option(
    "--from",
    "from_format",
    type=click.Choice(("auto", "pipe", "hf", "megatron")),
    default="auto",
    show_default=True,
    help="What SOURCE is (auto: a config.json means Hugging Face).",
)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="legacy")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="legacy")
@click.option(
    "--moe-ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="legacy, MoE: spread experts over this many of the tp ranks (the rest split each).",
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
    help="legacy: split the embedding table over tp ranks too.",
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
    help="Module patterns kept unquantized, e.g. 'model.layers.0.*' (legacy: "
    "'transformer.layers.0.*'; repeatable).",
)
@click.option(
    "--fp8-lm-head",
    is_flag=True,
    help="Quantize lm_head too (by default it stays in --dtype, as the engines recommend).",
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
    help="Read the export back and compare its logits with the source (auto: when it fits).",
)
@click.option("--allow-pickle", is_flag=True, help="hf input: accept pickled .bin weights.")
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
def export(source: Path, output: Path, **options: Any) -> None:
    """Export SOURCE (a pipe checkpoint, a Hugging Face directory or a Megatron torch_dist
    checkpoint) for TensorRT-LLM, vLLM or SGLang; a LoRA checkpoint is exported with its
    adapters merged into the base, or, with --peft, as the adapters alone."""
    if output.exists() and any(output.iterdir()) and not options["overwrite"]:
        raise click.UsageError(f"{output} exists and is not empty; pass --overwrite to replace it")
    base_model = options.pop("base_model")
    if base_model is not None and not options["peft"]:
        raise click.UsageError("--base-model is for --peft")
    if options.pop("peft"):
        from pipeline.export.peft import PeftExportError, export_peft

        try:
            click.echo(
                export_peft(
                    source,
                    output,
                    options["iteration"],
                    verify_checksums=options["verify_checksums"],
                    base_model=base_model,
                )
            )
        except PeftExportError as e:
            raise click.ClickException(str(e)) from None
        return
    target = _target(options)
    if options["fp8_kv_cache"] and not options["fp8"]:
        raise click.UsageError("--fp8-kv-cache needs --fp8")
    from pipeline.export.run import CalibrationSettings, ExportError, run_export

    try:
        export_options = _export_options(target, options)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    calibration = CalibrationSettings(
        options["calib_data"], options["calib_size"], options["calib_seq_len"]
    )
    try:
        summary = run_export(
            source,
            output,
            export_options,
            target=target,
            from_format=options["from_format"],
            calibration=calibration,
            iteration=options["iteration"],
            allow_pickle=options["allow_pickle"],
            verify=options["verify"],
            overwrite=options["overwrite"],
            quiet=options["quiet"],
            verify_checksums=options["verify_checksums"],
        )
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(summary)


def _export_options(target: str, options: dict[str, Any]) -> ExportOptions:
    """The `ExportOptions` of the command line (`LegacyExportOptions` for the legacy target,
    which adds the rank layout); a ValueError for an invalid combination."""
    from pipeline.export.options import ExportOptions

    common: dict[str, Any] = dict(
        dtype=options["dtype"],
        fp8=options["fp8"],
        fp8_kv_cache=options["fp8_kv_cache"],
        exclude_modules=(
            *(() if options["fp8_lm_head"] else ("lm_head",)),
            *options["fp8_exclude"],
        ),
    )
    if target != "legacy":
        return ExportOptions(**common)
    from pipeline.export.legacy_trtllm.config import LegacyExportOptions
    from pipeline.export.legacy_trtllm.layout import TrtllmMapping

    return LegacyExportOptions(
        mapping=TrtllmMapping(tp=options["tp"], pp=options["pp"], moe_ep=options["moe_ep"]),
        use_parallel_embedding=options["use_parallel_embedding"],
        embedding_sharding_dim=int(options["embedding_sharding_dim"]),
        **common,
    )


_LEGACY_ONLY = {  # option -> its value when not given
    "tp": 1,
    "pp": 1,
    "moe_ep": 1,
    "use_parallel_embedding": False,
    "embedding_sharding_dim": "0",
}


def _target(options: dict[str, Any]) -> str:
    """ "hf" or "legacy" from the engine flags; a UsageError for a conflicting combination."""
    engines = [f"--{name}" for name in ("trtllm", "vllm", "sglang") if options[name]]
    if len(engines) != 1:
        found = f" (got {' and '.join(engines)})" if engines else ""
        raise click.UsageError(
            f"say which engine to export for: one of --trtllm, --vllm, --sglang{found}"
        )
    if options["trtllm_format"] == "legacy":
        if not options["trtllm"]:
            raise click.UsageError(
                f"--trtllm-format legacy is a TensorRT-LLM format, not {engines[0]}"
            )
        return "legacy"
    for name, default in _LEGACY_ONLY.items():
        if options[name] != default:
            flag = "--" + name.replace("_", "-")
            raise click.UsageError(
                f"{flag} applies to --trtllm-format legacy only: engines shard a Hugging Face "
                "checkpoint when they load it"
            )
    return "hf"


if __name__ == "__main__":
    export()
