"""Training (`pipe train`), in rooms imported in one order, with no cycle: `config` (the schema,
its checks, recipes) < `state` (checkpoints and resume) < `objectives` and `optimizers` (one
registry each) < `assembly` (the run's config resolved and checked, layout, model, data) and
`report` (metrics, dry-run estimates, samples) < `loop` (the trainer and its step) <
`commands`. docs/architecture.md, "The training package", walks through them. Submodules are
imported where used, so importing this package stays cheap and never imports torch.
"""

# The composition root: the objectives' registry joins each objective's settings to the config
# (`add_section`), so any `TrainConfig` has its `[dpo]`-like sections whatever was imported
# first; the config itself names no objective. The registry is torch-free.
from pipeline.train import objectives as objectives
