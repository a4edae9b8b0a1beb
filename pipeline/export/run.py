"""One export from start to finish: open, calibrate (FP8), write, verify.

`pipe export` (commands.py) parses the command line and calls `run_export`; tests and scripts
may call it directly. `target` "hf" writes the Hugging Face checkpoint current engines load
(`hf_export.py`; FP8 in ModelOpt's format), "legacy" the TensorRT-LLM rank files of releases up
to 1.3 (`legacy_trtllm/`, features frozen).

Hugging Face exports are verified against our model on the source: bf16/fp16/fp32 by
transformers loading the directory (logits equal to the source rounded to the export dtype,
within `LOGIT_TOLERANCE`); FP8 by `ModelOptCheckpoint` reading the files back (format checks),
every weight scale covering its source weight (nothing saturates), and the dequantized model's
logits reaching `MIN_FP8_TOP1` top-1 agreement on held-out real text. DeepSeek-V3 models go
out in DeepSeek's block FP8 format, which needs no calibration (activations are scaled at run
time): `--calib-data`, if given, is only the verification text.

Legacy exports run the reference forward over the written rank files against our own model on
the source (`legacy_trtllm/verify.py`). `run_export` dispatches on the target for the writer and
the check; opening, the dtype choice and FP8 calibration are the same for both.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.common.progress import byte_progress, increments
from pipeline.common.quiet import quiet_dcp
from pipeline.export.verify_figures import ExportError
from pipeline.weights.formats import detect_format, open_source

if TYPE_CHECKING:
    import torch

    from pipeline.core.model.config import ModelConfig
    from pipeline.export.options import ExportOptions
    from pipeline.weights.source import TensorSource

__all__ = ["CalibrationSettings", "ExportError", "run_export"]


@dataclass(frozen=True)
class CalibrationSettings:
    """Where FP8 calibration reads text: a Megatron `.bin/.idx` prefix, `size` sequences of
    `seq_len` tokens (documents concatenated in order)."""

    data: Path | None = None
    size: int = 256
    seq_len: int = 512
    batch_size: int = 8


def _calibration_tokens(settings: CalibrationSettings, vocab_size: int) -> torch.Tensor:
    from pipeline.export.calibration import calibration_sequences

    if settings.data is None:
        raise ExportError("--fp8 needs calibration text: pass --calib-data PREFIX (a .bin/.idx)")
    tokens = calibration_sequences(settings.data, settings.size, settings.seq_len)
    if len(tokens) < settings.size:
        warnings.warn(
            f"{settings.data} holds only {len(tokens)} calibration sequences of "
            f"{settings.seq_len} tokens ({settings.size} asked for)",
            stacklevel=2,
        )
    if int(tokens.max()) >= vocab_size:
        raise ExportError(
            f"{settings.data}: token id {int(tokens.max())} is outside the model's vocabulary "
            f"({vocab_size}); was it tokenized with this model's tokenizer?"
        )
    return tokens


TARGETS = ("hf", "legacy")


def run_export(
    source_path: Path,
    output: Path,
    options: ExportOptions,
    *,
    target: str = "hf",
    from_format: str = "auto",
    calibration: CalibrationSettings | None = None,
    iteration: int | None = None,
    allow_pickle: bool = False,
    verify: str = "auto",
    overwrite: bool = False,
    quiet: bool = False,
    verify_checksums: bool = True,
) -> str:
    """Export and verify; returns a one-paragraph summary. Raises `ExportError`.

    `target` is "hf" or "legacy" (see the module docstring); the legacy target takes
    `LegacyExportOptions` (plain `ExportOptions` give one rank file). `options.dtype` None means
    the source's (`dtype_choice.default_dtype`); `verify` is auto (when the model fits in
    memory), on or off.
    """
    from pipeline.checkpoint.layout import CheckpointError
    from pipeline.export.block_fp8 import uses_block_fp8
    from pipeline.export.calibration import calibrate
    from pipeline.weights.checks import VerifyError
    from pipeline.weights.model import model_from_source

    options = _options_for(target, options)
    try:
        with quiet_dcp():
            fmt = detect_format(source_path) if from_format == "auto" else from_format
            source = open_source(
                source_path,
                fmt,
                iteration=iteration,
                allow_pickle=allow_pickle,
                verify_checksums=verify_checksums,
            )
            options, dtype_note = _resolved(options, source)
            calibration = calibration or CalibrationSettings()
            problem = _block_problem(source.model_config, target, options.fp8)
            if problem is not None:
                raise ExportError(problem)
            if target == "legacy":
                _refuse_legacy_family(source)
            _refuse_linear_attention(source, options, target)
            amax, calibrated, model = None, 0, None
            if options.fp8 and not (target == "hf" and uses_block_fp8(source)):
                tokens = _calibration_tokens(calibration, source.model_config.vocab_size)
                model = model_from_source(source)
                amax = calibrate(model, tokens, batch_size=calibration.batch_size)
                calibrated = tokens.numel()  # verification text starts after these
            total = sum(info.nbytes for info in source.tensors().values())
            start = time.perf_counter()
            with byte_progress(total, quiet, "export") as advance:
                what = _write(
                    source, source_path, output, options, target, amax, advance, overwrite
                )
            seconds = time.perf_counter() - start
            verdict = _verify(
                source, output, options, verify, calibration.data, calibrated, model, target
            )
    except (CheckpointError, VerifyError, ValueError, OSError) as e:
        raise ExportError(str(e)) from e
    fp8 = ", FP8" if options.fp8 else ""
    return f"wrote {output} ({what}, {dtype_note}{fp8}, in {seconds:.1f} s); {verdict}"


def _block_problem(config: ModelConfig, target: str, fp8: bool) -> str | None:
    """Why the model's blocks cannot go out as asked, or None: the legacy rank files and FP8's
    calibration know Llama's blocks only, not BLOOM's and MPT's (ALiBi, LayerNorm, a plain GeLU
    MLP), and the legacy files have no latent attention either; FP8 has no gpt-oss experts."""
    if target == "legacy" and config.mla is not None:
        return (
            "the legacy TensorRT-LLM format has no latent attention (DeepSeek-V3): export with "
            "--trtllm alone"
        )
    if fp8 and config.moe is not None and config.moe.expert_biases:
        return (
            "FP8 export of gpt-oss (fused experts with biases) is not written yet: "
            "export it without --fp8"
        )
    if config.position_embedding == "rope" and config.norm_type == "rmsnorm" and config.gated_mlp:
        return None
    if target == "legacy":
        return (
            "the legacy TensorRT-LLM format has no ALiBi, LayerNorm or plain MLP (BLOOM, "
            "MPT): export with --trtllm alone"
        )
    if fp8:
        return "FP8 export of BLOOM and MPT blocks is not supported: export bfloat16 or float16"
    return None


def _refuse_legacy_family(source) -> None:
    """The legacy format has none of GLM-4.5's or MiniMax-M2's pieces (partial RoPE, DeepSeek's
    or sigmoid routing, q/k norms over the projection): one line, before anything is read."""
    from pipeline.weights.hf_config import choose_architecture

    architecture = choose_architecture(source.model_config, source.metadata.get("hf_architecture"))
    if architecture in ("Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM"):
        raise ExportError(
            f"the legacy TensorRT-LLM format has no {architecture} (partial RoPE, sigmoid "
            "routing): export with --trtllm alone"
        )


def _refuse_linear_attention(source: TensorSource, options: ExportOptions, target: str) -> None:
    """ExportError for an FP8 or legacy export of a hybrid linear-attention model."""
    if source.model_config.linear_attention is not None and (options.fp8 or target == "legacy"):
        raise ExportError(
            "a model with linear attention (Qwen3.5, Qwen3-Next) exports to Hugging Face "
            "unquantized only: no FP8 format or legacy TensorRT-LLM layout here holds its "
            "gated DeltaNet layers"
        )


def _options_for(target: str, options: ExportOptions) -> ExportOptions:
    """`options` as `target` takes them (`LegacyExportOptions` for the legacy rank files); an
    `ExportError` for an unknown target or a Hugging Face export asked to be split."""
    from pipeline.export.legacy_trtllm.config import LegacyExportOptions

    if target not in TARGETS:
        raise ExportError(f"unknown export target {target!r}: use one of {', '.join(TARGETS)}")
    if target == "legacy":
        return LegacyExportOptions.from_options(options)
    if isinstance(options, LegacyExportOptions) and options.mapping.world_size != 1:
        raise ExportError("a Hugging Face export is not split: engines shard it when loading")
    return options


def _write(
    source: TensorSource,
    source_path: Path,
    output: Path,
    options: ExportOptions,
    target: str,
    amax: dict[str, float] | None,
    advance,
    overwrite: bool,
) -> str:
    """Write the export; returns what was written, in a few words."""
    if target == "legacy":
        from pipeline.export.legacy_trtllm.writer import write_trtllm

        write_trtllm(source, output, options, amax=amax, progress=advance, overwrite=overwrite)
        m = options.mapping
        return f"TensorRT-LLM legacy, tp {m.tp} x pp {m.pp} = {m.world_size} rank files"
    from pipeline.export.hf_export import source_tokenizer_dir, write_hf_export

    tokenizer = source_tokenizer_dir(source_path, source)
    write_hf_export(
        source,
        output,
        options,
        amax=amax,
        tokenizer_dir=tokenizer,
        progress=increments(advance),
        overwrite=overwrite,
    )
    kind = "Hugging Face checkpoint"
    if options.fp8:
        from pipeline.export.block_fp8 import uses_block_fp8

        kind = ("DeepSeek block FP8 " if uses_block_fp8(source) else "ModelOpt FP8 ") + kind
    return kind + ("" if tokenizer else ", no tokenizer files found to copy")


def _resolved(options: ExportOptions, source: TensorSource) -> tuple[ExportOptions, str]:
    """`options` with the dtype and architecture the source implies where left unset, and
    the dtype with the reason for it (`DtypeChoice.describe`)."""
    import dataclasses

    from pipeline.weights.dtype_choice import DtypeChoice, choose_dtype

    choice = choose_dtype(options.dtype, source)
    if options.fp8 and choice.name == "float32" and not choice.requested:
        choice = DtypeChoice("bfloat16", "the compute dtype of FP8 exports of fp32 weights")
    options = dataclasses.replace(options, dtype=choice.name)
    if options.architecture is None:
        architecture = source.metadata.get("hf_architecture")
        options = dataclasses.replace(options, architecture=architecture)
    return options, choice.describe()


def _verify(
    source: TensorSource,
    output: Path,
    options: ExportOptions,
    mode: str,
    text: Path | None,
    skip_tokens: int,
    source_model: torch.nn.Module | None,
    target: str = "legacy",
) -> str:
    from pipeline.weights.checks import fits_in_memory

    if mode == "off":
        return "not verified (--verify off)"
    if not fits_in_memory(source, copies=4.0):
        if mode == "on":
            raise ExportError("the model does not fit in memory for the reference forward")
        return "not verified (too large for the reference forward in memory)"
    if target == "hf":
        from pipeline.export.verify_hf import verify_hf_export as verify_export
    else:
        from pipeline.export.legacy_trtllm.verify import verify_export
    return verify_export(
        source, output, options, text=text, skip_tokens=skip_tokens, source_model=source_model
    )
