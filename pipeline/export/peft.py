"""`pipe export CKPT --peft --output DIR`: a LoRA checkpoint's adapters as Hugging Face PEFT
files (`adapter_config.json`, `adapter_model.safetensors`) under transformers' module names,
which `peft` (`PeftModel.from_pretrained(base, DIR)`) and vLLM (`--lora-modules name=DIR`)
load onto the base model. The base itself is exported as usual (`pipe export` or
`pipe convert --to hf` of the base checkpoint).

`adapter_config.json`'s `base_model_name_or_path` is what peft's `AutoPeftModelForCausalLM` loads
the base from: `--base-model` when given (a Hugging Face directory or hub id), else the Hugging
Face directory the adapters were trained on, directly or through the pipe checkpoint `pipe
convert` made of it (its recorded `converted_from`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["PeftExportError", "export_peft", "hf_base"]


class PeftExportError(RuntimeError):
    """An adapter export that cannot be done; the message says why."""


def export_peft(
    source: Path,
    output: Path,
    iteration: int | None = None,
    *,
    verify_checksums: bool = True,
    base_model: str | None = None,
) -> str:
    """Write the adapters of the LoRA checkpoint `source` into `output`, naming `base_model` (or
    the Hugging Face base found, module docstring) as their base; returns a summary."""
    from pipeline.checkpoint.layout import CheckpointError
    from pipeline.common.quiet import quiet_dcp
    from pipeline.weights.hf_config import choose_architecture
    from pipeline.weights.lora_files import lora_record, write_peft
    from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

    try:
        with quiet_dcp():
            adapters = PipeCheckpointSource(source, iteration, verify_checksums=verify_checksums)
            record = lora_record(adapters.directory)
            if record is None:
                raise PeftExportError(
                    f"{adapters.directory} is a full checkpoint, not a LoRA one (pipe train "
                    "--lora): --peft exports adapters only"
                )
            base = record["base"]["path"]
            recorded = adapters.metadata.get("hf_architecture")
            if base is not None and recorded is None:  # a base converted from transformers
                recorded = _base_architecture(Path(base))
            architecture = choose_architecture(adapters.model_config, recorded)
            named = base_model or hf_base(base)
            names = write_peft(adapters, record, output, architecture, named or base)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        raise PeftExportError(str(e)) from e
    hint = "" if named or base is None else "; peft cannot load it: pass --base-model"
    return (
        f"wrote {output} (peft LoRA for {architecture}: {len(names)} tensors, rank "
        f"{record['rank']}, alpha {record['alpha']:g}; base {named or base or 'random init'}"
        f"{hint})"
    )


def hf_base(base: str | None) -> str | None:
    """The Hugging Face directory behind a LoRA run's base: the base itself when it is one, the
    directory a pipe base was converted from when that still is one, else None."""
    from pipeline.checkpoint.layout import CheckpointError
    from pipeline.checkpoint.loader import resolve_checkpoint
    from pipeline.weights.formats import detect_format

    if base is None or not Path(base).exists():
        return None
    if detect_format(Path(base)) == "hf":
        return base
    try:
        _, record = resolve_checkpoint(Path(base), None)
    except (CheckpointError, OSError, ValueError):  # an unreadable base names no directory
        return None
    origin = (record.get("metadata") or {}).get("converted_from")
    if origin and Path(origin).is_dir() and detect_format(Path(origin)) == "hf":
        return str(origin)
    return None


def _base_architecture(base: Path) -> str | None:
    """The transformers architecture a LoRA base records: a pipe checkpoint converted from
    Hugging Face, or a Hugging Face model directory itself."""
    from pipeline.weights.formats import detect_format, open_source

    return open_source(base, detect_format(base), verify_checksums=False).metadata.get(
        "hf_architecture"
    )
