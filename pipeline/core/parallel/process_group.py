"""Running a command on several processes, shared by `pipe train`, `pipe generate` and
`pipe serve`: the torchrun relaunch, the device choice, the process group's start and end.

`--nproc-per-node N` (N > 1) re-launches the same command under torchrun
(`python -m torch.distributed.run --nproc-per-node N -m pipeline COMMAND ARGS`) unless this
process already is one of torchrun's (LOCAL_RANK and WORLD_SIZE set); each rank then takes its
own GPU (`cuda:LOCAL_RANK`) and joins the default process group (nccl on CUDA, gloo on a CPU).
Only the standard library is imported at module level (torch inside the functions), so the
command modules that import this stay instant for `--help`.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch

__all__ = [
    "NoCudaDevice",
    "choose_device",
    "destroy_process_group",
    "launched_by_torchrun",
    "launched_world_size",
    "rank_device",
    "relaunch_under_torchrun",
    "start_process_group",
    "strip_nproc",
    "torchrun_command",
]


class NoCudaDevice(RuntimeError):
    """A CUDA device was asked for, and torch sees none."""


def launched_by_torchrun() -> bool:
    """True inside a process that torchrun started (LOCAL_RANK and WORLD_SIZE are set)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """The world size when this process is one of torchrun's, else 1."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def strip_nproc(args: Sequence[str], command: str) -> list[str]:
    """`args` without `--nproc-per-node N` / `--nproc-per-node=N` (and a leading `command`)."""
    args = list(args)
    if args and args[0] == command:
        args = args[1:]
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def torchrun_command(nproc_per_node: int, command: str, args: Sequence[str]) -> list[str]:
    """The command line that runs `pipe COMMAND ARGS` on `nproc_per_node` local processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc_per_node),
        "-m",
        "pipeline",
        command,
        *strip_nproc(args, command),
    ]


def torchrun_environment(environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment to run torchrun in, and the variables added to `environ`: with
    OMP_NUM_THREADS unset, 1. torchrun gives each process one thread then anyway, and prints a
    four-line banner saying so; set here, it shows in pipe's one line instead."""
    added = {} if "OMP_NUM_THREADS" in environ else {"OMP_NUM_THREADS": "1"}
    return {**environ, **added}, added


def relaunch_under_torchrun(nproc_per_node: int, command: str) -> NoReturn:
    """Replace this process by torchrun running the same `pipe COMMAND` (never returns); the
    torchrun command line, with the variables pipe set for it, is written to stderr first."""
    line = torchrun_command(nproc_per_node, command, sys.argv[1:])
    environment, added = torchrun_environment(dict(os.environ))
    print(" ".join([*(f"{k}={v}" for k, v in added.items()), *line]), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, line, environment)


def choose_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else the CPU; any other name as torch reads it
    (`cpu`, `cuda`, `cuda:1`; RuntimeError for one it does not know). `NoCudaDevice` when a
    CUDA device is named and torch sees none."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NoCudaDevice(f"{name}: torch sees no CUDA device")
    return device


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: on CUDA its own GPU, `cuda:LOCAL_RANK` (0 without torchrun), made
    the current one; any other device as it is."""
    import torch

    if device.type != "cuda":
        return device
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def start_process_group(device: torch.device) -> None:
    """Join the default process group (nccl for a CUDA `device`, else gloo) unless this
    process already has one; torchrun's environment says where the others are. DTensor's
    hint about gathers it cannot merge stays out of the output
    (`quiet_unmergeable_gather_hints`)."""
    import torch.distributed as dist

    from pipeline.common.quiet import quiet_unmergeable_gather_hints

    quiet_unmergeable_gather_hints()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


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
