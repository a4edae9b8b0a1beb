"""`pipe export CKPT --peft --output DIR`: a LoRA checkpoint's adapters as Hugging Face PEFT
files (`adapter_config.json`, `adapter_model.safetensors`) under transformers' module names,
which `peft` (`PeftModel.from_pretrained(base, DIR)`) and vLLM (`--lora-modules name=DIR`)
load onto the base model. The base itself is exported as usual (`pipe export` or
`pipe convert --to hf` of the base checkpoint)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["PeftExportError", "export_peft"]


class PeftExportError(RuntimeError):
    """An adapter export that cannot be done; the message says why."""


def export_peft(
    source: Path, output: Path, iteration: int | None = None, *, verify_checksums: bool = True
) -> str:
    """Write the adapters of the LoRA checkpoint `source` into `output`; returns a summary."""
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
            names = write_peft(adapters, record, output, architecture, base)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        raise PeftExportError(str(e)) from e
    return (
        f"wrote {output} (peft LoRA for {architecture}: {len(names)} tensors, rank "
        f"{record['rank']}, alpha {record['alpha']:g}; base {base or 'random init'})"
    )


def _base_architecture(base: Path) -> str | None:
    """The transformers architecture a LoRA base records: a pipe checkpoint converted from
    Hugging Face, or a Hugging Face model directory itself."""
    from pipeline.weights.formats import detect_format, open_source

    return open_source(base, detect_format(base), verify_checksums=False).metadata.get(
        "hf_architecture"
    )
