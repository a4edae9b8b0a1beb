"""Everything pipe measures on a GPU, in one run that always leaves a report.

`scripts/gpu/run.sh` calls this after installing the carried wheels. The steps run in order of
value, each in a child process (its whole process group killed when its time is up) under its own
time budget, and the report (`gpu_report.json` and `gpu_report.md` in the output folder) is
rewritten before and after every step, so a step that fails or runs out of time costs its own
figures and nothing else; the benchmarks write their JSON after every run, so a step cut short
keeps what it measured. Every child's output goes to `gpu_run.log`.

    environment   the carried wheels' install (timed by run.sh) and GPU, driver, torch, CUDA,
                  cuDNN, NCCL, packages
    gpu_tests     bring-up: the `gpu`-marked tests
    decode        decoding with and without CUDA graphs, Llama 3.2 1B shape in bf16, batch 1, 8,
                  64, 256 (quick: 1, 64), and the share of the memory-bandwidth limit at batch 1;
                  the 56M model of `generate` at batch 1 against the first run's 154 tokens/s
                  (scripts/bench/decode.py)
    smoke_train   bring-up: `pipe train`, 10 steps in bf16 with compile (Llama 3.2 1B's width,
                  2 layers, seq 8192) on packed documents (compiled flex attention), no
                  checkpoint
    train_1b      bf16 training speed, Llama 3.2 1B shape, seq 8192 (scripts/bench/train.py)
    loss          the output layer and its loss at that shape, chunk scoring compiled against
                  eager (scripts/bench/loss.py; not in --quick)
    train_8b_fp8  bf16, then FP8 (torchao tensorwise, rowwise, rowwise_with_gw_hp; quick:
                  tensorwise), Llama 3 8B width with 8 layers, seq 8192, one invocation
    attention     attention kernels at seq 8192 with document masking (scripts/bench/attention.py);
                  the fastest of pipe's backends recorded as `auto`'s choice (--record)
    memory        `pipe train --dry-run --gpu` estimate against the measured peaks above
    grpo          a GRPO step on the 1B shape (scripts/bench/grpo.py): its parts' shares and the
                  rollouts' tokens/s against the engine alone (not in --quick)
    generate      scripts/bench/generate.py on the GPU against transformers (not in --quick)
    lora_8b       LoRA (`llama3_8b_lora`) against full fine-tuning (train_8b_fp8's bf16 run) at
                  the 8B width with 8 layers: step time and peak memory (not in --quick)
    muon          the optimizer step of Muon against AdamW's on the 1B shape, eager as in the
                  train step, and their states' bytes (scripts/bench/optimizer_step.py; not in
                  --quick)
    linear_attention  gated DeltaNet's delta rule at Qwen3.5's shape in bf16: the Triton kernels
                  of flash-linear-attention against pipe's torch chunked form (differences and
                  speed) and that against the recurrent form (scripts/bench/linear_attention.py;
                  not in --quick)

Modes: full (`STEPS` budgets add up to <= 300 s with the install, `--quick` to <= 150 s) and
`--dry` (a CPU at tiny sizes with emulated FP8, so CI proves the script; what a CPU cannot
measure is marked "not on a CPU" in the report, never dropped). `--only STEP[,STEP]` runs the
named steps, `--skip STEP[,STEP]` (repeatable) leaves steps out. A step ends by the sum of the
budgets up to its own (`plan_deadlines`): time an earlier step leaves goes to the next, and
steps chosen by `--only` share the whole call in proportion to their budgets, so the second
call of a lease gives the steps the first could not finish the time they need.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

FULL, QUICK, DRY = "full", "quick", "dry"
# Seconds for the whole call per mode, the wheels' install included: two full calls and the
# machine's start fit a 15-minute GPU lease. Each step's own budget is in STEPS.
TOTAL_S = {FULL: 300, QUICK: 150, DRY: 900}
FP8_RECIPES = {
    FULL: "torchao:tensorwise,torchao:rowwise,torchao:rowwise_with_gw_hp",
    QUICK: "torchao:tensorwise",
    DRY: "torchao:tensorwise,torchao:rowwise,torchao:rowwise_with_gw_hp",
}


@dataclass
class Run:
    """The state of one measurement run: mode, folders, deadline, and the report so far."""

    mode: str
    out: Path
    deadline: float
    work: Path
    steps: list[dict] = field(default_factory=list)
    install_s: float = 0.0  # run.sh's wheel install, counted in the environment step
    step_deadline: float = math.inf  # the running step's, shared by all its commands
    step_deadlines: dict[str, float] = field(default_factory=dict)  # from `plan_deadlines`

    @property
    def on_gpu(self) -> bool:
        return self.mode != DRY

    def command(self, name: str, argv: list[str]) -> tuple[int | None, str]:
        """Run `argv` from the repository root until the step's budget (and never past the
        run's deadline); append its output to the log. Returns (exit code or None if it ran
        out of time, its output). On time out the whole process group is killed, so the
        benchmarks' own children do not go on holding the GPU."""
        budget = max(1.0, min(self.step_deadline, self.deadline) - time.monotonic())
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        child = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = child.communicate(timeout=budget)
            code, output = child.returncode, stdout + stderr
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            code = None
            output = stdout + stderr + f"\n[timed out after {budget:.0f} s]"
        with open(self.out / "gpu_run.log", "a") as log:
            log.write(f"\n===== {name}: {' '.join(argv)}\n{output}\n")
        return code, output


def _status(code: int | None) -> str:
    return "ok" if code == 0 else ("timed out" if code is None else f"failed (exit {code})")


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------- the steps

ENV_PROBE = r"""
import json, platform, importlib.metadata as md, subprocess, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
facts = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
         "cpus": __import__("os").cpu_count()}
for name in ("torchao", "transformers", "gigatoken", "tokenizers", "numpy", "triton",
             "flash-attn", "transformer-engine"):
    facts[name] = version(name)
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    facts.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                 gpu_memory_gib=round(props.total_memory / 2**30, 1),
                 multiprocessors=props.multi_processor_count,
                 nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        facts["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except OSError:
        facts["driver"] = None
else:
    facts["gpu"] = None
print(json.dumps(facts))
"""


def step_environment(run: Run) -> dict:
    code, output = run.command("environment", [PY, "-c", ENV_PROBE])
    facts = json.loads(output.strip().splitlines()[-1]) if code == 0 else {}
    note = "" if facts.get("gpu") or not run.on_gpu else "no CUDA GPU visible"
    if not run.on_gpu:
        note = "CPU dry run: no GPU, driver, NCCL"
    facts["wheel_install_s"] = run.install_s
    return {
        "status": _status(code),
        "figures": facts,
        "note": note or _last_line(output),
        "extra_s": run.install_s,
    }


def step_gpu_tests(run: Run) -> dict:
    # Only the files that hold gpu tests: collecting the others would import test oracles
    # (megatron-core, ...) that the GPU machine does not carry.
    files = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )
    # -v: a line per test as it ends, so a call cut short still tells which passed.
    argv = [
        PY,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-v",
        "--durations=5",
        "-p",
        "no:cacheprovider",
        *files,
    ]
    code, output = run.command("gpu_tests", argv)
    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", output, re.MULTILINE)
    counts: dict[str, object] = dict(Counter(result.lower() for _, result in results))
    if failed := [test for test, result in results if result in ("FAILED", "ERROR")]:
        counts["not passed"] = failed
    deselected = re.search(r"(\d+) deselected", output)
    if not run.on_gpu:
        return {
            "status": "not on a CPU",
            "figures": counts,
            "note": f"collected; every gpu test skips without CUDA "
            f"({counts.get('skipped', 0)} skipped, {deselected[1] if deselected else 0} "
            "other tests deselected)",
        }
    # pytest exits 5 when nothing ran, 1 when something failed.
    status = "ok" if code == 0 and not counts.get("skipped") else _status(code)
    if code == 0 and counts.get("skipped"):
        status = "ok, with skips"
    return {"status": status, "figures": counts, "note": _last_line(output)}


# The first H200 run's pipe generate at batch 1 on the 56M model, before CUDA graphs (issue 48).
FIRST_RUN_SMALL_TOK_S = 154.0


def step_decode(run: Run) -> dict:
    """Decoding with and without CUDA graphs: tokens/s per batch size, the bandwidth share."""
    result = run.work / "decode.json"
    sizes = {
        FULL: "--device cuda --batches 1,8,64,256 --steps 64 --small",
        QUICK: "--device cuda --batches 1,64 --steps 32",
        DRY: "--device cpu --flavor tiny --batches 1,4 --prompt-len 24 --steps 4 --small",
    }[run.mode].split()
    before = ["--small-before", str(FIRST_RUN_SMALL_TOK_S)]
    argv = [PY, "scripts/bench/decode.py", *sizes, *before, "--json", str(result)]
    code, output = run.command("decode", argv)
    record = _read_json(result) or {}
    note = (
        "bf16, random weights, prompts of 160 tokens, 64 timed steps; targets: >= 900 "
        "tokens/s at batch 1 on the 1B, >= 5x 154 tokens/s on the 56M"
        if run.on_gpu
        else "CPU, fp32, tiny sizes: the static step eagerly in place of graphs"
    )
    if code != 0:
        note += f"; {_last_line(output)}"
    return {"status": _status(code), "figures": record, "note": note}


# Packed documents (the mock data's EOD tokens; what SFT and packed pre-training runs see): on
# CUDA `auto` then trains through compiled flex attention, which no gpu test compiles.
DOCUMENTS = ["--set", "data.reset_attention_mask=true", "--set", "data.reset_position_ids=true"]


def _train_argv(run: Run) -> list[str]:
    if run.on_gpu:
        return [
            "--recipe",
            "llama3_2_1b",
            "--device",
            "cuda",
            "--iters",
            "10",
            "--tp",
            "1",
            "--seq-length",
            "8192",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "1",
            "--set",
            "model.num_layers=2",
            "--set",
            "training.compile=true",
            *DOCUMENTS,
        ]
    return [
        "--recipe",
        "tiny",
        "--device",
        "cpu",
        "--iters",
        "10",
        "--global-batch-size",
        "4",
        "--set",
        "training.compile=false",
        *DOCUMENTS,
    ]


def step_smoke_train(run: Run) -> dict:
    run_dir = run.work / "smoke_train"
    argv = [
        PY,
        "-m",
        "pipeline",
        "train",
        *_train_argv(run),
        "--run-dir",
        str(run_dir),
        "--set",
        "training.eval_interval=0",
        "--set",
        "checkpoint.enable=false",
        "--set",
        "logging.tensorboard=false",
        "--set",
        "training.log_interval=1",
        "--set",
        "scheduler.warmup_iters=2",
        "--set",
        "scheduler.decay_iters=10",
    ]
    code, output = run.command("smoke_train", argv)
    losses = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("split") == "train" and "loss" in record:
                losses.append(record["loss"])
    figures: dict[str, object] = {"steps_logged": len(losses)}
    if backend := re.search(r"attention backend: (.+)", output):
        figures["attention_backend"] = backend[1].strip()
    if losses:
        figures.update(first_loss=losses[0], last_loss=losses[-1])
    note = _last_line(output)
    if not run.on_gpu:
        note = "CPU: tiny recipe in fp32 without compile (bf16 and compile run on the GPU)"
    if code == 0 and losses and not losses[-1] < losses[0]:
        return {"status": "failed (loss did not fall)", "figures": figures, "note": note}
    return {"status": _status(code), "figures": figures, "note": note}


def step_attention(run: Run) -> dict:
    result = run.work / "attention.json"
    sizes = {
        FULL: ["--seq", "8192", "--repeat", "5"],
        QUICK: ["--seq", "8192", "--repeat", "3"],
        DRY: [
            "--device",
            "cpu",
            "--seq",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--doc-len",
            "64",
            "--repeat",
            "2",
        ],
    }[run.mode]
    # --record: the fastest of pipe's backends becomes `auto`'s choice for this GPU and shape
    # (pipe's cache on a GPU; the dry run's goes to its work folder, not the user's cache).
    choices = [] if run.on_gpu else [str(run.work / "attention_backends.json")]
    argv = [PY, "scripts/bench/attention.py", *sizes, "--record", *choices, "--json", str(result)]
    code, output = run.command("attention", argv)
    record = _read_json(result) or {}
    recorded = record.get("recorded") or {}
    choice = recorded.get("backend") or recorded.get("error", "nothing recorded")
    note = f"auto's choice: {choice}"
    if not run.on_gpu:
        note += "; CPU, seq 256, fp32: kernel availability only"
    return {"status": _status(code), "figures": record.get("results", {}), "note": note}


# The training benchmarks' settings, shared with the memory step's dry runs.
BENCH_1B = {
    FULL: ["--set", "parallel.tp=1", "--set", "training.global_batch_size=4"],
    QUICK: ["--set", "parallel.tp=1", "--set", "training.global_batch_size=2"],
    DRY: [
        "--set",
        "parallel.tp=1",
        "--set",
        "training.global_batch_size=4",
        "--set",
        "model.num_layers=2",
        "--set",
        "data.seq_length=256",
    ],
}
BENCH_8B = {
    FULL: ["--set", "model.num_layers=8", "--set", "training.global_batch_size=2"],
    QUICK: ["--set", "model.num_layers=8", "--set", "training.global_batch_size=1"],
    # fp32: torchao follows CUDA autocast only, so on a CPU under bf16 autocast its
    # high-precision weight-gradient GEMM would mix bf16 and fp32.
    DRY: [
        "--set",
        "model.num_layers=1",
        "--set",
        "training.global_batch_size=4",
        "--set",
        "training.dtype=fp32",
    ],
}


def _bench_train(
    run: Run, name: str, recipe: str, fp8: str, sets: list[str], profile: bool = False
) -> dict:
    result = run.work / f"{name}.json"
    # Two warm-up steps: compile's first step and any recompile of the second stay untimed.
    steps = {
        FULL: ["--warmup", "2", "--steps", "4"],
        QUICK: ["--warmup", "2", "--steps", "2"],
        DRY: ["--warmup", "1", "--steps", "2"],
    }[run.mode]
    # Where the time goes (the MFU target was missed on the first GPU run): 2 more steps under
    # the profiler, after the figures are saved, not in a quick run.
    if profile and run.mode != QUICK:
        steps += ["--profile", "2"]
    device = ["--device", "cuda" if run.on_gpu else "cpu"]
    argv = [
        PY,
        "scripts/bench/train.py",
        "--recipe",
        recipe,
        "--fp8",
        fp8,
        *steps,
        *device,
        *sets,
        "--json",
        str(result),
    ]
    code, output = run.command(name, argv)
    record = _read_json(result) or {}  # written after every run: what finished survives
    figures = {"bf16": record.get("bf16"), **(record.get("fp8") or {})}
    note = f"recipe {recipe} {' '.join(s for s in sets if s != '--set')}"
    if not run.on_gpu:
        note += "; CPU, tiny sizes" + (", emulated FP8" if fp8 != "none" else "")
        note += ": checks the path, not speed"
    if code != 0:
        note += f"; {_last_line(output)}"
    return {"status": _status(code), "figures": figures, "note": note}


def step_train_1b(run: Run) -> dict:
    recipe = "llama3_2_1b" if run.on_gpu else "tiny"
    return _bench_train(run, "train_1b", recipe, "none", BENCH_1B[run.mode], profile=True)


def step_loss(run: Run) -> dict:
    """The output layer and its loss at the 1B shape: chunk scoring compiled against eager."""
    result = run.work / "loss.json"
    sizes = (
        []
        if run.on_gpu
        else [
            "--device",
            "cpu",
            "--tokens",
            "512",
            "--hidden",
            "64",
            "--vocab",
            "4000",
            "--repeat",
            "2",
        ]
    )
    code, output = run.command("loss", [PY, "scripts/bench/loss.py", *sizes, "--json", str(result)])
    note = "8192 tokens x hidden 2048 x vocab 128256, bf16" if run.on_gpu else "CPU, fp32, tiny"
    return {
        "status": _status(code),
        "figures": _read_json(result) or {},
        "note": note if code == 0 else f"{note}; {_last_line(output)}",
    }


def step_train_8b_fp8(run: Run) -> dict:
    recipe = "llama3_8b" if run.on_gpu else "tiny"
    return _bench_train(run, "train_8b_fp8", recipe, FP8_RECIPES[run.mode], BENCH_8B[run.mode])


ESTIMATE = re.compile(r"total ~ ([\d.]+) GiB \(none\) / ([\d.]+) GiB \(full\)")


def step_memory(run: Run) -> dict:
    gpu = None
    env = next((s for s in run.steps if s["name"] == "environment"), {}).get("figures", {})
    for known in ("h100", "h200", "a100", "b200"):
        if known in str(env.get("gpu") or "").lower():
            gpu = known if known != "a100" else "a100-80gb"
    figures, problems = {}, []
    cases = (("train_1b", "llama3_2_1b", BENCH_1B), ("train_8b_fp8", "llama3_8b", BENCH_8B))
    for name, recipe, sets in cases:
        recipe = recipe if run.on_gpu else "tiny"
        measured = (_read_json(run.work / f"{name}.json") or {}).get("bf16") or {}
        argv = [
            PY,
            "-m",
            "pipeline",
            "train",
            "--recipe",
            recipe,
            "--dry-run",
            "--set",
            "training.dtype=bf16",
            *sets[run.mode],
            *(["--gpu", gpu] if gpu else []),
        ]
        code, output = run.command(f"memory {name}", argv)
        found = ESTIMATE.search(output)
        if code != 0 or not found:
            problems.append(f"{name}: dry run {_status(code)} {_last_line(output)}")
            continue
        estimate = float(found[1])  # the benchmarks run without activation checkpointing
        entry = {"estimate_gib": estimate, "measured_peak_gib": measured.get("peak_gib")}
        if measured.get("peak_gib"):
            entry["estimate_over_measured"] = estimate / measured["peak_gib"]
            entry["within_15_percent"] = abs(estimate / measured["peak_gib"] - 1) <= 0.15
        figures[name] = entry
    status = "ok" if not problems else "failed"
    note = "; ".join(problems)
    if not run.on_gpu:
        status = "not on a CPU" if not problems else status
        note = note or "estimate checked for parsing; a CPU's peak RSS is no GPU memory peak"
    return {"status": status, "figures": figures, "note": note}


def step_generate(run: Run) -> dict:
    result = run.work / "generate.json"
    sizes = {
        FULL: ["--device", "cuda", "--batch", "8", "--new-tokens", "32"],
        QUICK: ["--device", "cuda", "--batch", "4", "--new-tokens", "16"],
        DRY: [
            "--device",
            "cpu",
            "--hidden",
            "128",
            "--layers",
            "2",
            "--batch",
            "4",
            "--new-tokens",
            "8",
            "--prompt-len",
            "16",
        ],
    }[run.mode]
    argv = [PY, "scripts/bench/generate.py", *sizes, "--json", str(result)]
    code, output = run.command("generate", argv)
    record = _read_json(result) or {}
    return {
        "status": _status(code),
        "figures": {"runs": record.get("runs")},
        "note": "" if run.on_gpu else "CPU, fp32, a 2-layer model",
    }


def step_lora_8b(run: Run) -> dict:
    """LoRA's step time and peak memory against full fine-tuning, same model and batch. The full
    run is train_8b_fp8's bf16 run (the same recipe and settings) when that step measured it."""
    on_gpu = ("llama3_8b_lora", "llama3_8b")
    lora_recipe, full_recipe = on_gpu if run.on_gpu else ("tiny_lora", "tiny")
    lora = _bench_train(run, "lora_8b_lora", lora_recipe, "none", BENCH_8B[run.mode])
    statuses, notes = [lora["status"]], [f"lora: {lora['note']}"]
    full = (_read_json(run.work / "train_8b_fp8.json") or {}).get("bf16")
    if full and "error" not in full:
        notes.append("full: train_8b_fp8's bf16 run")
    else:
        result = _bench_train(run, "lora_8b_full", full_recipe, "none", BENCH_8B[run.mode])
        full = result["figures"].get("bf16")
        statuses.append(result["status"])
        notes.append(f"full: {result['note']}")
    figures = {"lora": lora["figures"].get("bf16"), "full": full}
    mine, theirs = figures["lora"] or {}, full or {}
    if mine.get("step_s") and theirs.get("step_s"):
        figures["lora_over_full_step"] = mine["step_s"] / theirs["step_s"]
        figures["lora_over_full_peak"] = mine["peak_gib"] / theirs["peak_gib"]
    status = next((s for s in statuses if s != "ok"), "ok")
    return {"status": status, "figures": figures, "note": "; ".join(notes)}


@dataclass(frozen=True)
class Step:
    """One step of the run: its name, what it measures, and its seconds per mode (0: not run)."""

    name: str
    measure: Callable[[Run], dict]
    budget: dict[str, int]


def step_grpo(run: Run) -> dict:
    """One GRPO step on the 1B shape: its parts' shares and rollouts against the engine alone."""
    result = run.work / "grpo.json"
    sizes = {
        FULL: [
            "--recipe",
            "llama3_2_1b",
            "--device",
            "cuda",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--set",
            "parallel.tp=1",
            "--set",
            "data.seq_length=1024",
            "--set",
            "grpo.max_completion_length=128",
            "--set",
            "training.global_batch_size=8",
            "--set",
            "training.micro_batch_size=1",
            "--set",
            "training.compile=false",
        ],
        QUICK: [],
        DRY: ["--steps", "1", "--warmup", "1"],
    }[run.mode]
    argv = [PY, "scripts/bench/grpo.py", *sizes, "--json", str(result)]
    code, output = run.command("grpo", argv)
    record = _read_json(result) or {}
    return {
        "status": _status(code),
        "figures": record,
        "note": "8 prompts x 8 completions of <= 128 tokens, seq 1024, eager"
        if run.on_gpu
        else "CPU, fp32, a 4-layer model",
    }


def step_muon(run: Run) -> dict:
    """Muon's optimizer step against AdamW's on the 1B shape (fp32 weights, random gradients)."""
    result = run.work / "optimizer_step.json"
    sizes = {
        FULL: [
            "--recipe",
            "llama3_2_1b",
            "--device",
            "cuda",
            "--set",
            "parallel.tp=1",
            "--warmup",
            "1",
            "--steps",
            "3",
        ],
        QUICK: [],
        DRY: ["--recipe", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "2"],
    }[run.mode]
    argv = [
        PY,
        "scripts/bench/optimizer_step.py",
        "--optimizers",
        "adamw,muon",
        *sizes,
        "--json",
        str(result),
    ]
    code, output = run.command("muon", argv)
    record = _read_json(result) or {}
    return {
        "status": _status(code),
        "figures": record.get("runs", {}),
        "note": (
            "Llama 3.2 1B, 1 + 3 eager steps each"
            if run.on_gpu
            else "CPU, the tiny recipe: checks the path, not speed"
        )
        + ("" if code == 0 else f"; {_last_line(output)}"),
    }


def step_linear_attention(run: Run) -> dict:
    """Gated DeltaNet's delta rule: flash-linear-attention's Triton kernel against pipe's torch
    chunked form (differences, speed), and that against the recurrent form, by length."""
    result = run.work / "linear_attention.json"
    shape = {
        FULL: "--device cuda --dtype bf16 --lengths 4096,16384 --heads 32 --key-dim 128 "
        "--value-dim 128",
        QUICK: "",
        DRY: "--device cpu --lengths 64,256 --heads 2 --key-dim 16 --value-dim 16",
    }[run.mode]
    argv = [PY, "scripts/bench/linear_attention.py", *shape.split(), "--fla"]
    code, output = run.command("linear_attention", [*argv, "--json", str(result)])
    record = _read_json(result) or {}
    figures = record.get("results", {})
    fla = [f.get("fla") for f in figures.values() if "fla" in f]
    note = "Qwen3.5's linear-attention shape, bf16" if run.on_gpu else "CPU, tiny sizes"
    if fla:
        note += f"; fla: {fla[0]}"
    return {
        "status": _status(code),
        "figures": figures,
        "note": note + ("" if code == 0 else f"; {_last_line(output)}"),
    }


# In order of value: what a call cut short loses is what matters least. A full run's budgets
# add up to its 300 s; they follow the first H200 run's wall times (gpu_tests: 17 s for 8 tests,
# now 15, one compiled; smoke_train's first step, compiling, 10 s, more with flex attention now;
# train_8b_fp8 ran bf16 and one FP8 recipe in 70 s, four runs need about 100). What does not
# fit, the tail (generate, lora_8b, muon get what the steps before them leave), is a second
# call's `--only`, whose chosen steps share its whole 300 s. grpo comes before them: it is the
# one figure issue 39 waits for. decode comes right after the bring-up: issue 48 puts decoding
# through CUDA graphs first, and its 35 s came from smoke_train (5), train_8b_fp8 (15, whose
# four runs already needed a second call), attention (10) and grpo (5). linear_attention
# (issue 51) took 4 s of gpu_tests' margin; like the tail, it runs on what is left.
STEPS: list[Step] = [
    Step("environment", step_environment, {FULL: 12, QUICK: 12, DRY: 60}),  # install + probe
    Step("gpu_tests", step_gpu_tests, {FULL: 38, QUICK: 30, DRY: 300}),
    Step("decode", step_decode, {FULL: 35, QUICK: 15, DRY: 240}),
    Step("smoke_train", step_smoke_train, {FULL: 33, QUICK: 20, DRY: 300}),
    Step("train_1b", step_train_1b, {FULL: 35, QUICK: 25, DRY: 300}),
    Step("loss", step_loss, {FULL: 8, QUICK: 0, DRY: 60}),
    Step("train_8b_fp8", step_train_8b_fp8, {FULL: 67, QUICK: 35, DRY: 400}),
    Step("attention", step_attention, {FULL: 18, QUICK: 10, DRY: 120}),
    Step("memory", step_memory, {FULL: 2, QUICK: 3, DRY: 120}),  # no torch import
    Step("grpo", step_grpo, {FULL: 40, QUICK: 0, DRY: 240}),
    Step("generate", step_generate, {FULL: 5, QUICK: 0, DRY: 180}),
    Step("lora_8b", step_lora_8b, {FULL: 2, QUICK: 0, DRY: 200}),
    Step("muon", step_muon, {FULL: 1, QUICK: 0, DRY: 120}),
    Step("linear_attention", step_linear_attention, {FULL: 4, QUICK: 0, DRY: 120}),
]


def budget_total(mode: str) -> int:
    """The seconds a mode's steps may take in all (install included: it is the environment's)."""
    return sum(step.budget[mode] for step in STEPS)


def choose_steps(only: str | None, skip: list[str]) -> list[str]:
    """The names of the steps to run, in STEPS order: those `--only` names (comma-separated;
    default all) less those `--skip` names. Raises ValueError on a name that is no step."""
    names = [step.name for step in STEPS]
    wanted = _names(only) if only else names
    left_out = {name for value in skip for name in _names(value)}
    unknown = [name for name in [*wanted, *left_out] if name not in names]
    if unknown:
        raise ValueError(f"unknown step {unknown[0]!r}; the steps: {', '.join(names)}")
    return [name for name in names if name in wanted and name not in left_out]


def plan_deadlines(mode: str, chosen: list[str], start: float) -> dict[str, float]:
    """When each chosen step must end: `start` (the call's, the wheels' install included) plus
    the budgets of the chosen steps up to and including it. So a step that ends early leaves
    its time to the next ones, and none eats into the budgets of those after it. When the
    chosen steps' budgets add up to less than the call's time (an `--only` rerun of steps that
    ran out of time), each budget is scaled up so that they share the whole call."""
    budgets = [step.budget[mode] for step in STEPS if step.name in chosen]
    scale = max(1.0, TOTAL_S[mode] / max(sum(budgets), 1))
    deadlines, end = {}, start
    for step in STEPS:
        if step.name in chosen:
            end += step.budget[mode] * scale
            deadlines[step.name] = end
    return deadlines


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


# --------------------------------------------------------------------------------- the report


def write_report(run: Run) -> None:
    """Rewrite gpu_report.json and gpu_report.md from the steps so far (atomically): each step's
    status, wall time against its budget (this mode's, and a full and a quick run's), figures."""
    record = {
        "mode": run.mode,
        "total_s": TOTAL_S[run.mode],
        "budget_full_s": budget_total(FULL),
        "budget_quick_s": budget_total(QUICK),
        "steps": run.steps,
    }
    _atomic_write(run.out / "gpu_report.json", json.dumps(record, indent=1) + "\n")
    lines = [
        f"# pipe on the GPU machine ({run.mode} run)",
        "",
        f"Budgets: a full run's steps {budget_total(FULL)} s of its {TOTAL_S[FULL]} s, a "
        f"quick run's {budget_total(QUICK)} s of {TOTAL_S[QUICK]} s (wheel install "
        "included in the environment's). Allowed: the seconds a step had when it started, "
        "its budget plus what the steps before it left unspent (scaled up when `--only` "
        "chose fewer steps than fill the call).",
        "",
        "| step | status | seconds | budget | full / quick budget | allowed | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for step in run.steps:
        note = str(step.get("note", "")).replace("|", "/")
        allowed = f"{step['allowed_s']:.0f}" if "allowed_s" in step else ""
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']:.0f} | "
            f"{step['budget_s']} | {step['budget_full_s']} / {step['budget_quick_s']} "
            f"| {allowed} | {note} |"
        )
    spent = sum(step["seconds"] for step in run.steps)
    budgets = sum(s["budget_s"] for s in run.steps)
    lines.append(
        f"| total | | {spent:.0f} | {budgets} | {budget_total(FULL)} / "
        f"{budget_total(QUICK)} | {TOTAL_S[run.mode]} | |"
    )
    for step in (step for step in run.steps if step["figures"]):
        lines += ["", f"## {step['name']}", ""]
        lines += [f"- {key}: {_short(value)}" for key, value in step["figures"].items()]
    _atomic_write(run.out / "gpu_report.md", "\n".join(lines) + "\n")


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items())
    if isinstance(value, list):  # the first few (a profile's top kernels); the JSON has all
        more = ", ..." if len(value) > 5 else ""
        return "[" + "; ".join(_short(v) for v in value[:5]) + more + "]"
    return str(value)


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def run_step(run: Run, step: Step, chosen: bool) -> None:
    """Run one step under its budget (or record why it did not run) and rewrite the report
    before and after it: a call cut off mid-step still shows where it stopped."""
    entry = {
        "name": step.name,
        "seconds": 0.0,
        "budget_s": step.budget[run.mode],
        "budget_full_s": step.budget[FULL],
        "budget_quick_s": step.budget[QUICK],
    }
    started = time.monotonic()
    if not chosen:
        result = {"status": "skipped (--only/--skip)", "figures": {}}
    elif not step.budget[run.mode]:
        result = {"status": f"skipped (not in a {run.mode} run)", "figures": {}}
    elif started >= run.deadline:
        result = {"status": "not run (the run's time was spent)", "figures": {}}
    else:
        cut_off = "cut off (the call ended during this step)"
        run.steps.append({**entry, "status": cut_off, "figures": {}})
        write_report(run)
        run.steps.pop()
        run.step_deadline = run.step_deadlines.get(step.name, started + step.budget[run.mode])
        entry["allowed_s"] = round(min(run.step_deadline, run.deadline) - started, 1)
        try:
            result = step.measure(run)
        except Exception as e:  # a broken step costs its own figures only
            result = {"status": f"failed ({type(e).__name__}: {e})", "figures": {}}
        entry["seconds"] = time.monotonic() - started + result.pop("extra_s", 0.0)
    run.steps.append({**entry, **result})
    write_report(run)
    print(f"[gpu] {step.name}: {result['status']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"within {TOTAL_S[QUICK]} s")
    mode.add_argument("--dry", action="store_true", help="a CPU at tiny sizes (CI)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    parser.add_argument("--skip", action="append", default=[], help="step names to leave out")
    parser.add_argument("--install-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        chosen = choose_steps(args.only, args.skip)
    except ValueError as e:
        print(f"measure.py: {e}", file=sys.stderr)
        sys.exit(2)
    mode = DRY if args.dry else QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_run.log").write_text("")
    start = time.monotonic() - args.install_s
    with tempfile.TemporaryDirectory(prefix="pipe_gpu_") as work:
        run = Run(
            mode,
            args.out,
            start + TOTAL_S[mode],
            Path(work),
            install_s=args.install_s,
            step_deadlines=plan_deadlines(mode, chosen, start),
        )
        for step in STEPS:
            run_step(run, step, step.name in chosen)
    print(f"[gpu] report: {args.out / 'gpu_report.md'}")
    done = ("ok", "not on a CPU", "skipped")
    failed = [s["name"] for s in run.steps if not s["status"].startswith(done)]
    if failed:
        print(f"[gpu] steps that did not finish: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
