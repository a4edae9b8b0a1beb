"""Training: config and recipes, LR schedules, the optimizer registry, dry-run estimates, trainer.

The config (`config`: the schema; `config_checks`, `model_overrides`; `config_loader` layers it
and reads the loaded checkpoint's model once) reads no file itself. The trainer's loop
(`trainer`) runs each step through `train_step` and a step runner (`step_runner`, or
`pipeline_step` for pipeline stages). Submodules are imported where used, so importing this
package stays cheap and never imports torch.
"""
