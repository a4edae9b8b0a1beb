"""The run's configuration: the schema (`schema.py`: sections of plain dataclasses that read no
file), the field types it allows (`fields.py`), its cross-field checks (`checks.py`), how a config
is resolved from defaults, a recipe, `--set` and flags (`loader.py`, recipes in
`pipeline/train/recipes/`), TOML in and out (`toml_io.py`), and the model settings a checkpoint
or Hugging Face directory fixes (`model_overrides.py`). Nothing here imports torch."""
