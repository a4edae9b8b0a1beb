"""The run's state on disk: `RunState` (`run_state.py`: save, async save, resume, `--finetune`,
the start from a Hugging Face directory, `checkpoint.save_hf`), its adapter hook chosen from the
config (`adapters.py`; LoRA's in `lora_run.py`), the check of a checkpoint's model against the
config (`checkpoint_model.py`) and Hugging Face weights into and out of the sharded model
(`hf_weights.py`)."""
