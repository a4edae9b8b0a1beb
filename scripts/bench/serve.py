"""Serving speed: `pipe serve` under a bounded streamed load, against a second OpenAI-compatible
server in the same run.

Builds a small random Llama-shaped model with transformers (default: 8 layers, hidden 512, 8 heads
over 4 kv heads, the Llama 2 tokenizer's 32,000 tokens, fp32) as a Hugging Face directory with
its tokenizer, starts `pipe serve` on it with pipe's defaults, and, at each concurrency (1, 8 and
32 by default), keeps that many streaming clients busy with completions of 64 new tokens on
64-token prompts cut from the Linux documentation corpus (token-id prompts, so both servers see
the same ids). It prints, per server and concurrency: streamed output tokens/s, time to first
token and whole-request latency (p50, p90, p99), then pipe / other. `--repeats N` runs each load
N times, the servers taking turns, and keeps each server's median run, so that a host whose speed
drifts over minutes weighs on both servers alike. Before the load, each server
answers a few prompts greedily, and their texts are compared with each other and with
transformers' `generate` on the same weights.

The second server runs the same directory, started by you before the run, e.g. vLLM's CPU build
(docs/benchmarks.md, "Serving"):

    python scripts/bench/serve.py --model-dir /tmp/serve-bench --build-only
    VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \\
        --model /tmp/serve-bench --dtype float32 --port 8100 &
    python scripts/bench/serve.py --model-dir /tmp/serve-bench --other http://127.0.0.1:8100

Without `--other` only pipe is measured. `--workload rl,eval` runs the shared-prefix workloads
instead (an RL step's rollouts, an evaluation harness's scoring requests; `serve_prefix.py`), with
prefix caching on in both servers (pipe's default and vLLM's). `--workload structured` prints
the cost per constrained token of structured output in pipe's engine: the decode step of a batch
of plain rows against the same batch with half its rows held to a JSON schema, over Llama 3's
128k vocabulary (`grammar_engines.engine_cost`; no server is started for it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from serve_prefix import import_httpx  # noqa: E402

DATA = Path(os.environ.get("PIPE_BENCH_DATA", ROOT.parent / "shared" / "data"))


def build_model(directory: Path, args: argparse.Namespace) -> None:
    """A random Llama over the Llama 2 tokenizer, saved with the tokenizer files."""
    import shutil

    import torch

    from pipeline.common.quiet import import_transformers

    transformers = import_transformers()
    tokenizer_dir = DATA / "tokenizers" / "llama2"
    if not tokenizer_dir.is_dir():
        raise SystemExit(f"{tokenizer_dir}: not found; set PIPE_BENCH_DATA to the data folder")
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a random model whose greedy text is not one token repeated,
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
        model.lm_head.weight.mul_(8)  # with clear winners: kernels' rounding picks the same
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)


def corpus_prompts(count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids, each from its own document of the Linux docs."""
    import zstandard

    from pipeline.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DATA / "tokenizers" / "llama2")
    prompts = []
    with open(DATA / "corpus" / "linux_docs.jsonl.zst", "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        lines = iter(reader.read(64 * 2**20).decode("utf-8", "ignore").splitlines())
        while len(prompts) < count:
            ids = tokenizer.encode_batch([json.loads(next(lines))["text"]])[0]
            if len(ids) >= length:
                prompts.append(ids[:length])
    return prompts


def transformers_greedy(directory: Path, prompts: list[list[int]], new: int) -> list[str]:
    import torch

    from pipeline.common.quiet import import_transformers
    from pipeline.tokenizer.tokenizer import load_tokenizer

    transformers = import_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = load_tokenizer(directory)
    texts = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new,
                do_sample=False,
                min_new_tokens=new,
                pad_token_id=0,
            )
        # the continuation's text: what the new tokens add after the prompt (a leading space)
        texts.append(tokenizer.decode(out[0].tolist())[len(tokenizer.decode(prompt)) :])
    return texts


async def one_request(client, url: str, model: str, prompt: list[int], new: int) -> dict:
    """One streamed completion: its first-token and total times, tokens and text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else new
    return {
        "ttft": (first or end) - start,
        "latency": end - start,
        "tokens": tokens,
        "text": "".join(text),
    }


async def load(
    url: str, model: str, prompts: list[list[int]], concurrency: int, new: int, rounds: int
) -> dict:
    """`concurrency` clients, each sending `rounds` requests one after another."""
    httpx = import_httpx()

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        queue = [prompts[i % len(prompts)] for i in range(concurrency * rounds)]

        async def worker(index: int) -> list[dict]:
            return [
                await one_request(client, url, model, queue[j], new)
                for j in range(index, len(queue), concurrency)
            ]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*map(worker, range(concurrency))) for r in rs]
        wall = time.perf_counter() - start
    return summarise(results, wall)


def summarise(results: list[dict], wall: float) -> dict:
    def pct(values: list[float], q: int) -> float:
        return (
            statistics.quantiles(values, n=100, method="inclusive")[q - 1]
            if len(values) > 1
            else values[0]
        )

    ttft = [r["ttft"] for r in results]
    latency = [r["latency"] for r in results]
    return {
        "requests": len(results),
        "tok_s": sum(r["tokens"] for r in results) / wall,
        **{f"ttft_p{q}": pct(ttft, q) for q in (50, 90, 99)},
        **{f"latency_p{q}": pct(latency, q) for q in (50, 90, 99)},
    }


async def greedy_texts(url: str, model: str, prompts: list[list[int]], new: int) -> list[str]:
    httpx = import_httpx()

    async with httpx.AsyncClient(timeout=600) as client:
        return [(await one_request(client, url, model, p, new))["text"] for p in prompts]


def model_name(url: str) -> str:
    httpx = import_httpx()

    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def start_pipe(directory: Path, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    httpx = import_httpx()

    args = [sys.executable, "-m", "pipeline", "serve", str(directory), "--port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(args, env=env, stderr=log.open("w"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"pipe serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("pipe serve did not start in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pipe-serve-bench"))
    parser.add_argument("--build-only", action="store_true", help="write the model and stop")
    parser.add_argument("--other", help="URL of the server to compare with (e.g. vLLM's)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=4, help="requests per client")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="loads per server and concurrency, the servers taking turns; the median is kept",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--check", type=int, default=8, help="prompts compared greedily")
    parser.add_argument("--pipe-args", default="", help="more `pipe serve` options (default: none)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument(
        "--workload",
        default="stream",
        help="comma-separated: stream (the streamed load above), rl, eval; or structured",
    )
    prefix_options(parser)
    args = parser.parse_args()

    if not (args.model_dir / "config.json").is_file():
        args.model_dir.mkdir(parents=True, exist_ok=True)
        build_model(args.model_dir, args)
    if args.build_only:
        print(f"model written to {args.model_dir}")
        return
    if args.workload == "structured":
        structured_cost(args)
        return
    servers = {"pipe": f"http://127.0.0.1:{args.port}"}
    if args.other:
        servers["other"] = args.other.rstrip("/")
    log = args.model_dir.parent / "pipe-serve-bench.log"
    process = start_pipe(args.model_dir, args.port, log, args.pipe_args.split())
    try:
        report = run_workloads(servers, args)
    finally:
        process.terminate()
        process.wait(60)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def structured_cost(args: argparse.Namespace) -> None:
    """The cost per constrained token (module docstring), on the benchmark's model shape."""
    from grammar_engines import engine_cost

    tokenizer = DATA / "tokenizers" / "llama3" / "tokenizer.json"
    sizes = argparse.Namespace(hidden=args.hidden, layers=args.layers, batch=16, steps=32, repeat=3)
    engine_cost(tokenizer, sizes)


def prefix_options(parser: argparse.ArgumentParser) -> None:
    """The shared-prefix workloads' sizes (`serve_prefix.py`)."""
    for name, default in (
        ("rl-prompts", 16),
        ("rl-n", 8),
        ("rl-prompt-len", 300),
        ("rl-system-len", 200),
        ("rl-new-tokens", 64),
        ("eval-questions", 125),
        ("eval-choices", 4),
        ("eval-prefix-len", 320),
        ("eval-question-len", 32),
        ("eval-choice-len", 8),
        ("eval-concurrency", 8),
        ("eval-max-tokens", 1),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)


def run_workloads(servers: dict, args: argparse.Namespace) -> dict:
    """The workloads `--workload` names, their figures in one report."""
    from serve_prefix import run_prefix_workloads

    workloads = args.workload.split(",")
    report: dict = {}
    if "stream" in workloads:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        prompts = corpus_prompts(max(concurrencies) * args.rounds, args.prompt_len)
        report = run(servers, prompts, concurrencies, args)
    shared = [w for w in workloads if w in ("rl", "eval")]
    if shared:
        names = {label: model_name(url) for label, url in servers.items()}
        count = max(2 * args.rl_prompts, args.eval_questions) + 1
        length = max(
            args.rl_prompt_len,
            args.eval_prefix_len,
            args.eval_question_len + args.eval_choices * args.eval_choice_len,
        )
        material = corpus_prompts(count, length)
        report["shared_prefix"] = run_prefix_workloads(servers, names, material, args, shared)
    return report


def run(servers: dict, prompts: list[list[int]], concurrencies: list[int], args) -> dict:
    names = {label: model_name(url) for label, url in servers.items()}
    checked = prompts[: args.check]
    reference = transformers_greedy(args.model_dir, checked, args.new_tokens)
    report = {"greedy_equal_to_transformers": {}, "runs": []}
    texts = {}
    for label, url in servers.items():
        texts[label] = asyncio.run(greedy_texts(url, names[label], checked, args.new_tokens))
        equal = sum(a == b for a, b in zip(texts[label], reference))
        report["greedy_equal_to_transformers"][label] = f"{equal}/{len(checked)}"
        print(f"{label}: greedy text equal to transformers' on {equal}/{len(checked)} prompts")
    if "other" in texts:
        equal = sum(a == b for a, b in zip(texts["pipe"], texts["other"]))
        report["greedy_pipe_equal_to_other"] = f"{equal}/{len(checked)}"
        print(f"pipe: greedy text equal to the other server's on {equal}/{len(checked)} prompts")
    for concurrency in concurrencies:
        row = measure_alternating(servers, names, prompts, concurrency, args)
        report["runs"].append(row)
        print_row(row)
    return report


def measure_alternating(servers: dict, names: dict, prompts, concurrency: int, args) -> dict:
    """Each server's figures at `concurrency`: `args.repeats` loads each, the servers taking
    turns (the order flipped every repeat), so a machine whose speed drifts over minutes (a
    shared host) weighs on both alike; each server's run of median tokens/s is kept, and each
    repeat's pipe / other ratio listed."""
    labels = list(servers)
    runs: dict = {label: [] for label in labels}
    for label in labels:  # warm
        asyncio.run(load(servers[label], names[label], prompts, concurrency, args.new_tokens, 1))
    for repeat in range(args.repeats):
        for label in labels if repeat % 2 == 0 else labels[::-1]:
            runs[label].append(
                asyncio.run(
                    load(
                        servers[label],
                        names[label],
                        prompts,
                        concurrency,
                        args.new_tokens,
                        args.rounds,
                    )
                )
            )
    row: dict = {"concurrency": concurrency}
    for label, figures in runs.items():
        row[label] = sorted(figures, key=lambda f: f["tok_s"])[len(figures) // 2]
    if "other" in runs:
        row["ratios"] = [p["tok_s"] / o["tok_s"] for p, o in zip(runs["pipe"], runs["other"])]
    return row


def print_row(row: dict) -> None:
    for label in ("pipe", "other"):
        if label in row:
            f = row[label]
            print(
                f"c={row['concurrency']:>3} {label:>5}: {f['tok_s']:8.1f} tok/s | TTFT p50 "
                f"{f['ttft_p50'] * 1000:7.1f} ms p90 {f['ttft_p90'] * 1000:7.1f} p99 "
                f"{f['ttft_p99'] * 1000:7.1f} | latency p50 {f['latency_p50']:6.2f} s p90 "
                f"{f['latency_p90']:6.2f} p99 {f['latency_p99']:6.2f}"
            )
    if "other" in row:
        pipe, other = row["pipe"], row["other"]
        speed, ttft = pipe["tok_s"] / other["tok_s"], pipe["ttft_p50"] / other["ttft_p50"]
        print(
            f"c={row['concurrency']:>3} pipe / other: tokens/s {speed:.2f}x, TTFT p50 {ttft:.2f}x"
        )
        if len(row["ratios"]) > 1:
            each = ", ".join(f"{ratio:.2f}x" for ratio in row["ratios"])
            print(f"c={row['concurrency']:>3} tokens/s ratio of each repeat: {each}")


if __name__ == "__main__":
    main()
