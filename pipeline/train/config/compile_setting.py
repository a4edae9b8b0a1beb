"""What `training.compile` means on a device, torch-free: the dry run's estimates ask it too."""

from __future__ import annotations

__all__ = ["compile_enabled"]


def compile_enabled(setting: bool | None, device_type: str) -> bool:
    """`training.compile`: True/False as given; unset (None) compiles on CUDA only (on a CPU
    compiling costs more time than a short run saves, and tests want eager numerics)."""
    return device_type == "cuda" if setting is None else setting
