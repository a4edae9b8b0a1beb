"""Training: config sections and recipes, LR schedules, optimizer, dry-run estimates, trainer.

Submodules are imported where used (`pipeline.train.config`, `.config_loader`, `.schedules`,
`.optimizer`, `.estimates`), so importing this package stays cheap and never imports torch.
"""
