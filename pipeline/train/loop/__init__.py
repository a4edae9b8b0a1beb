"""The training loop: the trainer (`trainer.py`, the algorithm), one optimizer step
(`train_step.py`), the step runners that carry micro-batches through the whole model or this
rank's pipeline stages (`step_runner.py`, `pipeline_step.py`), what the loop carries between steps
(`loop_state.py`), its guards (non-finite steps, stop signals: `guards.py`) and DeepSeek-V3's
expert-bias update after a step (`expert_bias.py`). These files name no objective, optimizer or
adapter: they call what `objectives/`, `optimizers/` and `state/` give them."""
