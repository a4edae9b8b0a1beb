"""The dtype a Hugging Face or TensorRT-LLM output is written in when none is asked for.

One rule serves `pipe convert --to hf` and `pipe export`: weights that came from Hugging Face
(an HF directory, or a pipe checkpoint `pipe convert --from hf` wrote, which records the source's
`hf_dtype`) go out in the dtype they came in, so a round trip changes no bit; anything else (a
trained checkpoint, whose fp32 master weights are a training artefact) goes out in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.weights.source import TensorSource

__all__ = ["OUTPUT_DTYPES", "DtypeChoice", "choose_dtype", "default_dtype"]

OUTPUT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class DtypeChoice:
    """An output dtype (`name`, as torch spells it), why it was chosen (a few words), and
    whether the user asked for it."""

    name: str
    reason: str
    requested: bool = False

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.name)

    def describe(self) -> str:
        """E.g. `float32, as the Hugging Face weights it came from (--dtype to change)`."""
        hint = "" if self.requested else " (--dtype to change)"
        return f"{self.name}, {self.reason}{hint}"


def default_dtype(source: TensorSource) -> DtypeChoice:
    """The dtype recorded for `source`'s Hugging Face weights, else bfloat16 (see the module
    docstring)."""
    declared = source.metadata.get("hf_dtype")
    if declared is None and source.metadata.get("hf_architecture"):
        # Converted before the dtype was recorded: the import kept the stored dtype.
        embedding = source.tensors().get("tok_embeddings.weight")
        declared = str(embedding.dtype).removeprefix("torch.") if embedding else None
    if declared in OUTPUT_DTYPES:
        return DtypeChoice(declared, "as the Hugging Face weights it came from")
    return DtypeChoice("bfloat16", "the default for a trained checkpoint")


def choose_dtype(requested: str | None, source: TensorSource) -> DtypeChoice:
    """`requested` (a torch dtype name) when given, else `default_dtype(source)`."""
    if requested is not None:
        return DtypeChoice(requested, "as --dtype asked", requested=True)
    return default_dtype(source)
