"""`pipe serve`'s engine threads on a busy machine: requests/s and latency for several
`--engine-threads` values while other processes keep cores busy.

Starts `pipe serve` on a model directory (e.g. the one `scripts/bench/serve.py --build-only`
writes) once per value, keeps `--busy` spinning processes running beside it (another job on the
machine), and at each concurrency sends `--requests` completions of `--new-tokens` tokens
(token-id prompts, greedy, `ignore_eos`) from that many clients at once. Prints, per value and
concurrency: requests/s, tokens/s, latency p50 and p90. Values run in turn, `--repeat` times, so a
drift of the machine's load shows as a spread rather than as a difference.

    python scripts/bench/serve.py --model-dir /tmp/serve-bench --build-only
    python scripts/bench/engine_threads.py --model-dir /tmp/serve-bench [--threads 0,1] [--busy 1]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve import start_pipe  # scripts/bench/serve.py, beside this script


def spin() -> None:
    while True:
        pass


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())


def load(port: int, concurrency: int, requests: int, new_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 30000) for _ in range(64)] for _ in range(requests)]

    def one(prompt: list[int]) -> float:
        begin = time.perf_counter()
        answer = post(
            port,
            {
                "model": None,
                "prompt": prompt,
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert answer["usage"]["completion_tokens"] == new_tokens, answer
        return time.perf_counter() - begin

    begin = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(one, prompts))
    wall = time.perf_counter() - begin
    return {
        "req_s": requests / wall,
        "tok_s": requests * new_tokens / wall,
        "p50": statistics.median(latencies),
        "p90": latencies[int(0.9 * (len(latencies) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--threads", default=f"0,1,{max(1, os.cpu_count() - 1)}")
    parser.add_argument("--busy", type=int, default=1, help="spinning processes beside it")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--port", type=int, default=8931)
    args = parser.parse_args()
    values = list(dict.fromkeys(int(t) for t in args.threads.split(",")))
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    print(f"{os.cpu_count()} cores, {args.busy} busy process(es) beside the server")
    try:
        for round_ in range(args.repeat):
            for threads in values:
                # serve.py's start: its log to a file, never a pipe nobody drains
                log = Path(tempfile.gettempdir()) / f"engine_threads_{threads}.log"
                server = start_pipe(
                    args.model_dir, args.port, log, ["--engine-threads", str(threads)]
                )
                try:
                    post(args.port, {"prompt": [5] * 8, "max_tokens": 2})  # warm up
                    for concurrency in map(int, args.concurrency.split(",")):
                        f = load(args.port, concurrency, args.requests, args.new_tokens, round_)
                        print(
                            f"round {round_ + 1} --engine-threads {threads} c={concurrency}: "
                            f"{f['req_s']:.2f} req/s {f['tok_s']:7.1f} tok/s latency p50 "
                            f"{f['p50']:.2f} s p90 {f['p90']:.2f} s",
                            flush=True,
                        )
                finally:
                    server.terminate()
                    server.wait(60)
    finally:
        for process in busy:
            process.terminate()


if __name__ == "__main__":
    main()
