"""`ExportOptions`: what a Hugging Face export (`--trtllm`, `--vllm`, `--sglang`) writes besides
the weights' values. The legacy TensorRT-LLM target extends it with its rank layout
(`legacy_trtllm.config.LegacyExportOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTYPES", "ExportOptions"]

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ExportOptions:
    """The export dtype, FP8 and what FP8 leaves unquantized."""

    dtype: str | None = "bfloat16"  # None: decided from the source (`default_dtype`)
    fp8: bool = False
    fp8_kv_cache: bool = False
    # fnmatch patterns of modules kept unquantized ("lm_head": the output layer)
    exclude_modules: tuple[str, ...] = ("lm_head",)
    architecture: str | None = None  # a preference (e.g. the HF source's); see choose_architecture

    def __post_init__(self) -> None:
        self._check_dtype()
        self._check_fp8()

    def _check_dtype(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")

    def _check_fp8(self) -> None:
        if self.fp8_kv_cache and not self.fp8:
            raise ValueError("the FP8 KV cache is part of the FP8 export: pass fp8 as well")
