"""Assembling a run: the layout and device (`layout.py`), the model on `meta`, split into this
rank's pipeline stages, parallelised, materialised and initialised (`model_build.py`,
`parallelize.py`, `model_parts.py`; what `training.compile` means: `compile_setting.py`), and
the data: blends, tokenizer, datasets and loaders (`train_data.py`)."""
