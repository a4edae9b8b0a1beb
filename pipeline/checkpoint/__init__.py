"""Sharded checkpoints on torch.distributed.checkpoint with atomic commit and integrity checks.

Modules: `layout` (names, tracker), `saver` (save + atomic commit + rotation),
`loader` (resolve + in-place load), `integrity` (verify), `safe_reader` (pickle-free DCP
metadata), `state` (tensor/JSON split, model + optimizer helpers), `rng`, `manager`, `commands`
(CLI). None of them imports torch at import time, so the CLI's help stays fast.
"""

from pipeline.checkpoint.integrity import CheckpointReport, verify, verify_save_dir
from pipeline.checkpoint.layout import CheckpointError
from pipeline.checkpoint.loader import load, read_checkpoint_record, resolve_checkpoint_dir
from pipeline.checkpoint.manager import CheckpointManager
from pipeline.checkpoint.rng import capture_rng_state, restore_rng_state
from pipeline.checkpoint.safe_reader import UnsafeCheckpointError
from pipeline.checkpoint.saver import AsyncSave, rotate, save
from pipeline.checkpoint.state import load_model_and_optimizer_state, model_and_optimizer_state

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointReport",
    "UnsafeCheckpointError",
    "capture_rng_state",
    "load",
    "load_model_and_optimizer_state",
    "model_and_optimizer_state",
    "read_checkpoint_record",
    "resolve_checkpoint_dir",
    "restore_rng_state",
    "rotate",
    "save",
    "verify",
    "verify_save_dir",
]
