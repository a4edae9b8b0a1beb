"""Adapters by name: pipe serve and vLLM on the same base and the same two exported adapters.

Trains two small LoRA adapters with `pipe train --lora` on the Hugging Face directory BASE (two
steps on mock tokens, other targets and seeds), exports each with `pipe export --peft`, then asks
transformers + peft, `pipe serve --lora-modules a=.. b=..` and vLLM (`--enable-lora
--lora-modules a=.. b=..`) for the greedy continuation of the same token-id prompts under the
model names a, b and the base, and prints whether all three agree. Not a test: vLLM is not in CI.

    python scripts/bench/serve.py --model-dir /tmp/lora-base --layers 2 --build-only
    python scripts/lora_vllm_check.py --base /tmp/lora-base --vllm-python /tmp/venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ["The quick brown fox", "def main():", "In 1969, the first", "Once upon a time"]
NEW_TOKENS = 16


def train_and_export(base: Path, work: Path, name: str, seed: int, targets: str) -> Path:
    """A LoRA run on `base` (two steps, mock tokens) exported as peft files; their directory."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    sets = [
        "data.mock=true",
        "data.seq_length=32",
        "data.num_workers=0",
        "training.iters=2",
        "training.micro_batch_size=2",
        "training.global_batch_size=2",
        "training.eval_interval=0",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "optimizer.lr=0.05",
        "scheduler.warmup_iters=0",
        f"training.seed={seed}",
        "lora.rank=8",
        "lora.alpha=16",
        f"lora.targets={targets}",
        "checkpoint.save_interval=2",
        f"logging.run_dir={work / ('run_' + name)}",
    ]
    Trainer(resolve_config(None, sets, {"load": str(base), "lora": True}), console=False).train()
    out = work / name
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "export",
            str(work / f"run_{name}" / "checkpoints"),
            "--peft",
            "-o",
            str(out),
            "--overwrite",
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return out


def peft_texts(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[str]:
    import torch
    import transformers

    from pipeline.tokenizer.tokenizer import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    tokenizer, texts = load_tokenizer(base), []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.eval().generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        # the whole text less the prompt's: a continuation's first space is decoded as servers do
        texts.append(tokenizer.decode(out[0].tolist())[len(tokenizer.decode(prompt)) :])
    return texts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, log: Path, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server did not start in {limit:.0f} s; see {log}")


def served_texts(url: str, model: str, prompts: list[list[int]]) -> list[str]:
    texts = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            texts.append(json.loads(response.read())["choices"][0]["text"])
    return texts


def serve(command: list[str], log: Path, env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    sink = open(log, "w")  # noqa: SIM115 - the server writes to it while it runs
    process = subprocess.Popen([*command, "--port", str(port)], stdout=sink, stderr=sink, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, log)
    return process, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="Hugging Face directory")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora-vllm-check"))
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm (else skipped)")
    args = parser.parse_args()
    from pipeline.tokenizer.tokenizer import load_tokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    adapters = {
        "a": train_and_export(args.base, args.work, "a", 1, '["q", "v", "down"]'),
        "b": train_and_export(args.base, args.work, "b", 2, '["k", "o", "gate", "up"]'),
    }
    prompts = load_tokenizer(args.base).encode_batch(PROMPTS)
    models = {"base": None, **adapters}
    results = {
        "transformers+peft": {m: peft_texts(args.base, p, prompts) for m, p in models.items()}
    }
    modules = [f"{name}={path}" for name, path in adapters.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    commands = {
        "pipe serve": [
            sys.executable,
            "-m",
            "pipeline",
            "serve",
            str(args.base),
            "--model-name",
            "base",
            "--lora-modules",
            *modules,
            "--max-loras",
            "2",
            "--engine-threads",
            "1",
        ]
    }
    if args.vllm_python:
        commands["vllm"] = [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(args.base),
            "--served-model-name",
            "base",
            "--dtype",
            "float32",
            "--enable-lora",
            "--lora-modules",
            *modules,
            "--max-loras",
            "2",
            "--max-lora-rank",
            "16",
            "--max-model-len",
            "512",
        ]
    for name, command in commands.items():
        print(f"$ {' '.join(command)}", flush=True)
        process, url = serve(command, args.work / f"{name.replace(' ', '_')}.log", env)
        try:
            results[name] = {m: served_texts(url, m, prompts) for m in models}
        finally:
            process.terminate()
            process.wait(60)
    reference = results["transformers+peft"]
    for name, texts in results.items():
        same = {m: texts[m] == reference[m] for m in models}
        print(
            f"{name:>18}: "
            + ", ".join(f"{m} {'same' if s else 'DIFFERENT'}" for m, s in same.items())
        )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
