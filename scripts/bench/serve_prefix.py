"""The shared-prefix workloads of `serve.py`: the loads a rollout engine and an evaluation harness
put on a server, where most prompt tokens repeat and prefix caching pays.

- RL-like (`rl`): `--rl-prompts` prompts (16), each a shared system prompt followed by a
  prompt of its own (about 300 tokens in all), sent at once with `n` 8 completions of
  `--rl-new-tokens` sampled tokens each (temperature 1, `ignore_eos`), as a GRPO step asks for
  its rollouts. A warm-up round with other prompts on the same system prompt comes first, so the
  measured round finds the system prompt cached and its own prompts not. Figure: generated
  tokens/s.
- Eval-like (`eval`): `--eval-questions` questions x `--eval-choices` choices scoring requests
  (125 x 4 = 500), as lm-evaluation-harness's `local-completions` sends a multiple-choice task's
  loglikelihood requests: token ids, `max_tokens` 1, `echo`, `logprobs` 1, temperature 0, each
  prompt a long few-shot prefix shared by all, the question, and one choice, by
  `--eval-concurrency` clients at once. Figure: scored prompt tokens/s; the echoed
  log-probabilities of the two servers are compared too (largest difference).
"""

from __future__ import annotations

import asyncio
import importlib
import time


def import_httpx():
    """httpx, or httpx2 (its successor, the same API) where only that is installed."""
    try:
        return importlib.import_module("httpx")
    except ImportError:
        return importlib.import_module("httpx2")


def rl_prompts(
    material: list[list[int]], count: int, system_len: int, prompt_len: int
) -> tuple[list[list[int]], list[list[int]]]:
    """A warm-up and a measured set of `count` prompts each: `system_len` tokens shared by all,
    then `prompt_len - system_len` of their own. `material`: 2 * count + 1 token lists."""
    system = material[0][:system_len]
    own = [system + ids[: prompt_len - system_len] for ids in material[1 : 2 * count + 1]]
    return own[:count], own[count:]


def eval_prompts(
    material: list[list[int]],
    questions: int,
    choices: int,
    prefix_len: int,
    question_len: int,
    choice_len: int,
) -> list[list[int]]:
    """`questions` x `choices` scoring prompts: a few-shot prefix of `prefix_len` tokens shared
    by all, then each question's `question_len` tokens, then one of its choices' `choice_len`.
    `material`: questions + 1 token lists of at least prefix_len and question_len +
    choices * choice_len tokens."""
    prefix = material[0][:prefix_len]
    prompts = []
    for ids in material[1 : questions + 1]:
        question, rest = ids[:question_len], ids[question_len:]
        for c in range(choices):
            prompts.append(prefix + question + rest[c * choice_len : (c + 1) * choice_len])
    return prompts


async def _post(client, url: str, body: dict) -> dict:
    response = await client.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:500]}")
    return response.json()


async def rl_load(url: str, model: str, prompts: list[list[int]], n: int, new: int) -> dict:
    """Every prompt at once with `n` sampled completions: generated tokens/s."""
    httpx = import_httpx()

    # no seed: vLLM's CPU build fails a seeded sampled request ("CPU Generator does not use
    # offset", 0.32.0)
    def body(prompt: list[int]) -> dict:
        return {
            "model": model,
            "prompt": prompt,
            "n": n,
            "max_tokens": new,
            "temperature": 1.0,
            "ignore_eos": True,
        }

    async with httpx.AsyncClient(timeout=1800) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(_post(client, url, body(p)) for p in prompts))
        wall = time.perf_counter() - start
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    cached = sum(_cached(a) for a in answers)
    return {
        "requests": len(prompts),
        "wall_s": wall,
        "tok_s": generated / wall,
        "generated_tokens": generated,
        "cached_prompt_tokens": cached,
    }


async def eval_load(
    url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict:
    """lm-eval's loglikelihood requests by `concurrency` clients: scored prompt tokens/s and
    each prompt's echoed log-probabilities."""
    httpx = import_httpx()

    logprobs: list[list[float | None]] = [[] for _ in prompts]

    async def worker(first: int, client) -> None:
        for i in range(first, len(prompts), concurrency):
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "echo": True,
            }
            answer = await _post(client, url, body)
            logprobs[i] = answer["choices"][0]["logprobs"]["token_logprobs"][: len(prompts[i])]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(k, client) for k in range(concurrency)))
        wall = time.perf_counter() - start
    scored = sum(map(len, prompts))
    return {
        "requests": len(prompts),
        "wall_s": wall,
        "tok_s": scored / wall,
        "prompt_tokens": scored,
        "logprobs": logprobs,
    }


def _cached(answer: dict) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def largest_difference(a: list[list[float | None]], b: list[list[float | None]]) -> float:
    """The largest |a - b| over the prompt positions both servers scored."""
    return max(
        (
            abs(x - y)
            for xs, ys in zip(a, b)
            for x, y in zip(xs, ys)
            if x is not None and y is not None
        ),
        default=float("nan"),
    )


def run_prefix_workloads(
    servers: dict, names: dict, material: list[list[int]], args, workloads: list[str]
) -> list[dict]:
    """Each of `workloads` (rl, eval) on each server, one server at a time; a row per workload
    with each server's figures and, with two servers, the ratio printed."""
    rows = []
    if "rl" in workloads:
        warm, measured = rl_prompts(
            material, args.rl_prompts, args.rl_system_len, args.rl_prompt_len
        )
        row = {"workload": "rl"}
        for label, url in servers.items():
            asyncio.run(rl_load(url, names[label], warm, args.rl_n, args.rl_new_tokens))
            row[label] = asyncio.run(
                rl_load(url, names[label], measured, args.rl_n, args.rl_new_tokens)
            )
        rows.append(_report(row, "generated"))
    if "eval" in workloads:
        prompts = eval_prompts(
            material,
            args.eval_questions,
            args.eval_choices,
            args.eval_prefix_len,
            args.eval_question_len,
            args.eval_choice_len,
        )
        row = {"workload": "eval"}
        for label, url in servers.items():
            load = (url, names[label], prompts, args.eval_concurrency, args.eval_max_tokens)
            asyncio.run(eval_load(*load[:2], prompts[: args.eval_concurrency], *load[3:]))  # warm
            row[label] = asyncio.run(eval_load(*load))
        if "other" in row:
            row["largest_logprob_difference"] = largest_difference(
                row["pipe"]["logprobs"], row["other"]["logprobs"]
            )
        for label in servers:
            del row[label]["logprobs"]
        rows.append(_report(row, "scored prompt"))
    return rows


def _report(row: dict, what: str) -> dict:
    for label in ("pipe", "other"):
        if label in row:
            f = row[label]
            print(
                f"{row['workload']:>4} {label:>5}: {f['tok_s']:8.1f} {what} tok/s "
                f"({f['requests']} requests in {f['wall_s']:.1f} s)"
            )
    if "other" in row:
        row["ratio"] = row["pipe"]["tok_s"] / row["other"]["tok_s"]
        print(f"{row['workload']:>4} pipe / other: tokens/s {row['ratio']:.2f}x")
    if "largest_logprob_difference" in row:
        print(
            f"eval: echoed logprobs, largest |pipe - other| {row['largest_logprob_difference']:.2e}"
        )
    return row
