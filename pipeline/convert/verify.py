"""Checks that a conversion kept the model: the same tensors, or the same logits.

`compare_tensors` streams both sides and requires bit-identical tensors (pipe -> pipe,
re-layout, and the pipe side of imports). `compare_hf_logits` runs the same tokens through our
`Transformer` (built from a `TensorSource`) and through transformers (from a Hugging Face
directory) and reports the largest absolute logit difference; with `layers=N` both models keep
only their first N layers, so a slice of a model too large for memory can still be checked.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.convert.source import TensorSource

__all__ = [
    "LOGIT_TOLERANCE",
    "VerifyError",
    "compare_hf_logits",
    "compare_tensors",
    "fits_in_memory",
]

LOGIT_TOLERANCE = 1e-4


class VerifyError(RuntimeError):
    """The converted checkpoint does not reproduce the source; the message says where."""


def compare_tensors(expected: TensorSource, actual: TensorSource) -> int:
    """Require the same names, shapes, dtypes and bit-identical values; returns the count."""
    import torch

    want, have = expected.tensors(), actual.tensors()
    if want.keys() != have.keys():
        missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
        raise VerifyError(f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, info in want.items():
        if have[name] != info:
            raise VerifyError(f"{name}: {have[name]} after conversion, {info} before")
        if not torch.equal(expected.read(name), actual.read(name)):
            raise VerifyError(f"{name}: values differ after conversion")
    return len(want)


def fits_in_memory(source: TensorSource, copies: float = 3.0) -> bool:
    """Whether `copies` fp32 copies of the model fit in half of the available memory."""
    fp32_bytes = sum(4 * info.nbytes // info.dtype.itemsize for info in source.tensors().values())
    return copies * fp32_bytes < 0.5 * available_memory_bytes()


def available_memory_bytes() -> int:
    """Memory the system can give us now: MemAvailable on Linux, else free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _sliced(source: TensorSource, layers: int | None) -> tuple[object, list[str]]:
    """The model config cut to the first `layers` layers, and the tensor names it keeps."""
    config = source.model_config
    if layers is not None:
        if not 1 <= layers <= config.num_layers:
            raise ValueError(f"layers={layers}: the model has {config.num_layers} layers")
        config = dataclasses.replace(config, num_layers=layers)
    keep = [
        name
        for name in source.tensors()
        if not name.startswith("layers.") or int(name.split(".")[1]) < config.num_layers
    ]
    return config, keep


def our_model(source: TensorSource, layers: int | None = None) -> torch.nn.Module:
    """Our `Transformer` in fp32 with `source`'s weights (first `layers` layers only)."""
    import torch

    from pipeline.core.model.transformer import Transformer

    config, names = _sliced(source, layers)
    model = Transformer(config)
    state = {name: source.read(name).float() for name in names}
    if config.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    model.rope.init_weights(torch.device("cpu"))
    model.tie_weights()
    return model.eval()


def compare_hf_logits(
    source: TensorSource,
    hf_dir: str | Path,
    *,
    layers: int | None = None,
    tokens: int = 32,
    seed: int = 0,
) -> float:
    """Max |logit difference| between our model from `source` and transformers' model from
    `hf_dir` on the same random tokens (fp32 on both sides); raises `VerifyError` above
    `LOGIT_TOLERANCE` times the logits' scale (at least 1)."""
    import torch

    from pipeline.common.quiet import import_transformers

    try:
        transformers = import_transformers()  # the summary line says what was compared
    except ImportError as e:  # pragma: no cover - the hf extra is missing
        raise VerifyError("verifying needs transformers: pip install 'pipe-llm[hf]'") from e
    ours = our_model(source, layers)
    overrides = {"num_hidden_layers": layers} if layers is not None else {}
    auto_model = transformers.AutoModelForCausalLM
    theirs = auto_model.from_pretrained(hf_dir, dtype=torch.float32, **overrides).eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, source.model_config.vocab_size, (2, tokens), generator=generator)
    with torch.no_grad():
        expected = theirs(ids).logits
        actual = ours.logits(ids)
    diff = float((expected - actual).abs().max())
    scale = max(1.0, float(expected.abs().max()))
    if diff > LOGIT_TOLERANCE * scale:
        raise VerifyError(
            f"logits differ by {diff:.3g} (tolerance {LOGIT_TOLERANCE * scale:.3g}) between "
            f"{source.metadata.get('source', 'the source')} and {hf_dir}"
        )
    return diff
