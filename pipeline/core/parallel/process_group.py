"""Ending a distributed run cleanly, shared by every command that starts a process group."""

from __future__ import annotations

import gc


def destroy_process_group() -> None:
    """Tear down the default process group if one is up (no-op otherwise).

    Called before the interpreter exits: gloo's worker threads that are still alive, or that free
    leftover async work (e.g. from checkpoint saves), during interpreter teardown abort the
    process with "terminate called without an active exception".
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
