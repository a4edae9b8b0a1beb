"""Model weights in every outside format, for every command that reads or writes them.

A `TensorSource` (`source.py`) is a model's weights under our parameter names, read one full
tensor at a time; `formats.py` detects what a path holds and opens its source: a pipe
checkpoint (`pipe_checkpoint.py`, which also writes weights-only checkpoints under any layout),
a Hugging Face directory (`hf_reader.py`, with the config mapping of `hf_config.py`) or a
Megatron `torch_dist` save (`megatron*.py`). `hf_writer.py` writes a Hugging Face directory,
`dtype_choice.py` picks the dtype an output is written in, `model.py` builds our model from a
source (`model_from_source`) and `checks.py` compares it with transformers.

`pipe convert`, `pipe export`, `pipe generate` / `pipe serve` and training all get weights
here; this package imports only `core`, `checkpoint`, `data`, `tokenizer` and `common`, never a
command's package.
"""

from pipeline.weights.formats import ConversionError, detect_format, open_source
from pipeline.weights.model import model_from_source

__all__ = ["ConversionError", "detect_format", "model_from_source", "open_source"]
