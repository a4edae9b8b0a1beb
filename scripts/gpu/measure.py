"""Everything pipe measures on a GPU, in one run that always leaves a report.

`scripts/gpu/run.sh` calls this after installing the carried wheels. The steps run in order, each
in a child process under its own time budget, and the report (`gpu_report.json` and
`gpu_report.md` in the output folder) is rewritten after every step, so a step that fails or runs
out of time costs its own figures and nothing else. Every child's output goes to `gpu_run.log`.

    environment   GPU, driver, torch, CUDA, cuDNN, NCCL, packages
    gpu_tests     the `gpu`-marked tests
    smoke_train   `pipe train`, 20 steps in bf16 with compile (Llama 3.2 1B's width, 2 layers)
    attention     attention kernels at seq 8192 with document masking (scripts/bench/attention.py)
    train_1b      bf16 training speed, Llama 3.2 1B shape, seq 8192 (scripts/bench/train.py)
    train_8b_fp8  FP8 (torchao tensorwise, rowwise, rowwise_with_gw_hp) and bf16, Llama 3 8B
                  width with 8 layers, seq 8192, one invocation
    memory        `pipe train --dry-run --gpu` estimate against the measured peaks above
    generate      scripts/bench/generate.py on the GPU against transformers
    lora_8b       LoRA (`llama3_8b_lora`) against full fine-tuning (`llama3_8b`) at the 8B
                  width with 8 layers: step time and peak memory of each

Modes: full (fits one 10-minute call), `--quick` (about 4 minutes: fewer steps and recipes) and
`--dry` (a CPU at tiny sizes with emulated FP8, so CI proves the script; what a CPU cannot
measure is marked "not on a CPU" in the report, never dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

FULL, QUICK, DRY = "full", "quick", "dry"
# Seconds for the whole run, per mode, and each step's own budget (full, quick, dry).
TOTAL_S = {FULL: 560, QUICK: 230, DRY: 900}
FP8_RECIPES = "torchao:tensorwise,torchao:rowwise,torchao:rowwise_with_gw_hp"


@dataclass
class Run:
    """The state of one measurement run: mode, folders, deadline, and the report so far."""

    mode: str
    out: Path
    deadline: float
    work: Path
    steps: list[dict] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.mode != DRY

    def command(self, name: str, argv: list[str], budget: float) -> tuple[int | None, str]:
        """Run `argv` from the repository root for at most `budget` seconds (and never past the
        run's deadline); append its output to the log. Returns (exit code or None if it ran
        out of time, its output)."""
        budget = max(1.0, min(budget, self.deadline - time.monotonic()))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            done = subprocess.run(
                argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            code = None
            output = _text(e.stdout) + _text(e.stderr) + f"\n[timed out after {budget:.0f} s]"
        with open(self.out / "gpu_run.log", "a") as log:
            log.write(f"\n===== {name}: {' '.join(argv)}\n{output}\n")
        return code, output


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


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
    code, output = run.command("environment", [PY, "-c", ENV_PROBE], 60)
    facts = json.loads(output.strip().splitlines()[-1]) if code == 0 else {}
    note = "" if facts.get("gpu") or not run.on_gpu else "no CUDA GPU visible"
    if not run.on_gpu:
        note = "CPU dry run: no GPU, driver, NCCL"
    return {"status": _status(code), "figures": facts, "note": note or _last_line(output)}


def step_gpu_tests(run: Run) -> dict:
    # Only the files that hold gpu tests: collecting the others would import test oracles
    # (megatron-core, ...) that the GPU machine does not carry.
    files = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )
    argv = [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    code, output = run.command("gpu_tests", argv, {FULL: 100, QUICK: 60, DRY: 300}[run.mode])
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", output)}
    deselected = re.search(r"(\d+) deselected", output)
    if not run.on_gpu:
        return {"status": "not on a CPU", "figures": counts,
                "note": f"collected; every gpu test skips without CUDA "
                f"({counts.get('skipped', 0)} skipped, {deselected[1] if deselected else 0} "
                "other tests deselected)"}  # fmt: skip
    # pytest exits 5 when nothing ran, 1 when something failed.
    status = "ok" if code == 0 and not counts.get("skipped") else _status(code)
    if code == 0 and counts.get("skipped"):
        status = "ok, with skips"
    return {"status": status, "figures": counts, "note": _last_line(output)}


def _train_argv(run: Run) -> list[str]:
    if run.on_gpu:
        return [
            "--recipe", "llama3_2_1b", "--device", "cuda", "--iters", "20", "--tp", "1",
            "--seq-length", "4096", "--global-batch-size", "4", "--micro-batch-size", "1",
            "--set", "model.num_layers=2", "--set", "training.compile=true",
        ]  # fmt: skip
    return [
        "--recipe", "tiny", "--device", "cpu", "--iters", "20", "--global-batch-size", "4",
        "--set", "training.compile=false",
    ]  # fmt: skip


def step_smoke_train(run: Run) -> dict:
    run_dir = run.work / "smoke_train"
    argv = [PY, "-m", "pipeline", "train", *_train_argv(run), "--run-dir", str(run_dir),
            "--set", "training.eval_interval=0", "--set", "checkpoint.save_interval=0",
            "--set", "logging.tensorboard=false", "--set", "training.log_interval=1",
            "--set", "scheduler.warmup_iters=2", "--set", "scheduler.decay_iters=20"]  # fmt: skip
    code, output = run.command("smoke_train", argv, {FULL: 120, QUICK: 90, DRY: 300}[run.mode])
    losses = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("split") == "train" and "loss" in record:
                losses.append(record["loss"])
    figures = {"steps_logged": len(losses)}
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
        FULL: ["--seq", "8192", "--repeat", "10"],
        QUICK: ["--seq", "8192", "--repeat", "3"],
        DRY: ["--device", "cpu", "--seq", "256", "--heads", "4", "--kv-heads", "2",
              "--head-dim", "32", "--doc-len", "64", "--repeat", "2"],
    }[run.mode]  # fmt: skip
    argv = [PY, "scripts/bench/attention.py", *sizes, "--json", str(result)]
    code, output = run.command("attention", argv, {FULL: 60, QUICK: 45, DRY: 120}[run.mode])
    record = _read_json(result) or {}
    return {"status": _status(code), "figures": record.get("results", {}),
            "note": "" if run.on_gpu else "CPU, seq 256, fp32: kernel availability only"}


# The training benchmarks' settings, shared with the memory step's dry runs.
BENCH_1B = {
    FULL: ["--set", "parallel.tp=1", "--set", "training.global_batch_size=4"],
    QUICK: ["--set", "parallel.tp=1", "--set", "training.global_batch_size=2"],
    DRY: ["--set", "parallel.tp=1", "--set", "training.global_batch_size=4",
          "--set", "model.num_layers=2", "--set", "data.seq_length=256"],
}  # fmt: skip
BENCH_8B = {
    FULL: ["--set", "model.num_layers=8", "--set", "training.global_batch_size=2"],
    QUICK: ["--set", "model.num_layers=8", "--set", "training.global_batch_size=1"],
    # fp32: torchao follows CUDA autocast only, so on a CPU under bf16 autocast its
    # high-precision weight-gradient GEMM would mix bf16 and fp32.
    DRY: ["--set", "model.num_layers=1", "--set", "training.global_batch_size=4",
          "--set", "training.dtype=fp32"],
}  # fmt: skip


def _bench_train(run: Run, name: str, recipe: str, fp8: str, sets: list[str], budget: dict):
    result = run.work / f"{name}.json"
    steps = {FULL: ["--warmup", "3", "--steps", "6"], QUICK: ["--warmup", "2", "--steps", "3"],
             DRY: ["--warmup", "1", "--steps", "2"]}[run.mode]  # fmt: skip
    device = ["--device", "cuda" if run.on_gpu else "cpu"]
    argv = [PY, "scripts/bench/train.py", "--recipe", recipe, "--fp8", fp8, *steps, *device,
            *sets, "--json", str(result)]  # fmt: skip
    code, output = run.command(name, argv, budget[run.mode])
    record = _read_json(result) or {}
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
    budget = {FULL: 130, QUICK: 80, DRY: 300}
    return _bench_train(run, "train_1b", recipe, "none", BENCH_1B[run.mode], budget)


def step_train_8b_fp8(run: Run) -> dict:
    recipes = FP8_RECIPES if run.mode != QUICK else "torchao:tensorwise,torchao:rowwise"
    recipe = "llama3_8b" if run.on_gpu else "tiny"
    budget = {FULL: 200, QUICK: 90, DRY: 400}
    return _bench_train(run, "train_8b_fp8", recipe, recipes, BENCH_8B[run.mode], budget)


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
        argv = [PY, "-m", "pipeline", "train", "--recipe", recipe, "--dry-run",
                "--set", "training.dtype=bf16", *sets[run.mode],
                *(["--gpu", gpu] if gpu else [])]  # fmt: skip
        code, output = run.command(f"memory {name}", argv, 60)
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
        FULL: ["--device", "cuda"],
        QUICK: ["--device", "cuda", "--batch", "8", "--new-tokens", "32"],
        DRY: ["--device", "cpu", "--hidden", "128", "--layers", "2", "--batch", "4",
              "--new-tokens", "8", "--prompt-len", "16"],
    }[run.mode]  # fmt: skip
    argv = [PY, "scripts/bench/generate.py", *sizes, "--json", str(result)]
    code, output = run.command("generate", argv, {FULL: 60, QUICK: 40, DRY: 180}[run.mode])
    record = _read_json(result) or {}
    return {"status": _status(code), "figures": {"runs": record.get("runs")},
            "note": "" if run.on_gpu else "CPU, fp32, a 2-layer model"}


def step_lora_8b(run: Run) -> dict:
    """LoRA's step time and peak memory against full fine-tuning, same model and batch."""
    recipes = ("llama3_8b_lora", "llama3_8b") if run.on_gpu else ("tiny_lora", "tiny")
    budget = {FULL: 60, QUICK: 40, DRY: 200}
    figures, statuses, notes = {}, [], []
    for label, recipe in zip(("lora", "full"), recipes):
        result = _bench_train(run, f"lora_8b_{label}", recipe, "none", BENCH_8B[run.mode], budget)
        figures[label] = result["figures"].get("bf16")
        statuses.append(result["status"])
        notes.append(f"{label}: {result['note']}")
    lora, full = figures.get("lora") or {}, figures.get("full") or {}
    if lora.get("step_s") and full.get("step_s"):
        figures["lora_over_full_step"] = lora["step_s"] / full["step_s"]
        figures["lora_over_full_peak"] = lora["peak_gib"] / full["peak_gib"]
    status = next((s for s in statuses if s != "ok"), "ok")
    return {"status": status, "figures": figures, "note": "; ".join(notes)}


STEPS: list[tuple[str, Callable[[Run], dict]]] = [
    ("environment", step_environment),
    ("gpu_tests", step_gpu_tests),
    ("smoke_train", step_smoke_train),
    ("attention", step_attention),
    ("train_1b", step_train_1b),
    ("train_8b_fp8", step_train_8b_fp8),
    ("memory", step_memory),
    ("generate", step_generate),
    ("lora_8b", step_lora_8b),
]


# --------------------------------------------------------------------------------- the report


def write_report(run: Run) -> None:
    """Rewrite gpu_report.json and gpu_report.md from the steps so far (atomically)."""
    record = {"mode": run.mode, "steps": run.steps}
    _atomic_write(run.out / "gpu_report.json", json.dumps(record, indent=1) + "\n")
    lines = [f"# pipe on the GPU machine ({run.mode} run)", "",
             "| step | status | seconds | note |", "| --- | --- | --- | --- |"]  # fmt: skip
    for step in run.steps:
        note = str(step.get("note", "")).replace("|", "/")
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']:.0f} | {note} |")
    for step in run.steps:
        lines += ["", f"## {step['name']}", ""]
        lines += [f"- {key}: {_short(value)}" for key, value in step["figures"].items()]
    _atomic_write(run.out / "gpu_report.md", "\n".join(lines) + "\n")


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items())
    return str(value)


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about 4 minutes")
    mode.add_argument("--dry", action="store_true", help="a CPU at tiny sizes (CI)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    args = parser.parse_args()
    chosen = DRY if args.dry else QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_run.log").write_text("")
    only = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory(prefix="pipe_gpu_") as work:
        run = Run(chosen, args.out, time.monotonic() + TOTAL_S[chosen], Path(work))
        for name, step in STEPS:
            if only is not None and name not in only:
                continue
            started = time.monotonic()
            if started >= run.deadline:
                result = {"status": "not run (the run's time was spent)", "figures": {}}
            else:
                try:
                    result = step(run)
                except Exception as e:  # a broken step costs its own figures only
                    result = {"status": f"failed ({type(e).__name__}: {e})", "figures": {}}
            run.steps.append({"name": name, "seconds": time.monotonic() - started, **result})
            write_report(run)
            print(f"[gpu] {name}: {result['status']}", flush=True)
    print(f"[gpu] report: {args.out / 'gpu_report.md'}")
    failed = [s["name"] for s in run.steps if not s["status"].startswith(("ok", "not on a CPU"))]
    if failed:
        print(f"[gpu] steps that did not finish: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
