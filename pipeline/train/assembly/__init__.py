"""Assembling a run: its config resolved and checked whole (`run_config.py`: the layers, the
loaded checkpoint's model, the objective's and the optimizer's problems), the layout and device
(`layout.py`), the model on `meta`, split into this rank's pipeline stages, parallelised,
materialised and initialised (`model_build.py`, `parallelize.py`, `model_parts.py`), and the
data: blends, tokenizer, the objective's datasets and loaders (`train_data.py`)."""
