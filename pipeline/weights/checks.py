"""Checks that weights still make the same model: logits against transformers, and whether a
model fits in memory for such a check.

`compare_hf_logits` runs the same tokens through our `Transformer` (built from a
`TensorSource`) and through transformers (from a Hugging Face directory) and reports the largest
absolute logit difference; with `layers=N` both models keep only their first N layers. Both
`pipe convert --to hf` and `pipe export` verify what they wrote with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.weights.model import model_from_source

if TYPE_CHECKING:
    from pipeline.weights.source import TensorSource

__all__ = [
    "LOGIT_TOLERANCE",
    "VerifyError",
    "available_memory_bytes",
    "compare_hf_logits",
    "fits_in_memory",
]

LOGIT_TOLERANCE = 1e-4


class VerifyError(RuntimeError):
    """The converted checkpoint does not reproduce the source; the message says where."""


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


def _causal_lm_class(transformers, hf_dir: Path):
    """The class config.json's `architectures` names when transformers has it (Mistral 4 has
    no AutoModelForCausalLM entry), else AutoModelForCausalLM."""
    import json

    try:
        names = json.loads((hf_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        names = []
    found = getattr(transformers, names[0], None) if names else None
    return found if hasattr(found, "from_pretrained") else transformers.AutoModelForCausalLM


def _first_layers(hf_dir: Path, layers: int) -> dict:
    """from_pretrained overrides keeping the first `layers` layers, the per-layer lists of the
    config (gpt-oss's `layer_types`, SmolLM3's `no_rope_layers`) cut to match."""
    import json

    config = json.loads((hf_dir / "config.json").read_text())
    per_layer = {k: config[k][:layers] for k in ("layer_types", "no_rope_layers") if config.get(k)}
    return {"num_hidden_layers": layers, **per_layer}


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
    ours = model_from_source(source, layers)
    overrides = _first_layers(Path(hf_dir), layers) if layers is not None else {}
    model_class = _causal_lm_class(transformers, Path(hf_dir))
    theirs = model_class.from_pretrained(hf_dir, dtype=torch.float32, **overrides).eval()
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
