"""pipe's tool-call parsers against vLLM's on the same texts: the cases of
tests/serve/test_tool_parsers.py read by vLLM's own parsers (`llama3_json`, `hermes`,
`pythonic`) in vLLM's environment, and by pipe's here; prints SAME or DIFF per case (the calls'
names, their `arguments` text byte for byte, and the content) and exits 1 on any difference.

vLLM is not a dependency of pipe (its CPU build pins its own torch): give the Python of a
virtual environment that has it (docs/benchmarks.md, "Serving" shows how).

    python scripts/tool_parsers_vllm_check.py --vllm-python /tmp/venv-vllm/bin/python \
        --tokenizer DIR

vLLM's parsers check at start that their marker tokens are in the tokenizer; they are added to
the tokenizer given (any Hugging Face tokenizer directory) before the parsers are built.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VLLM_SIDE = r"""
import json, logging, sys
logging.disable(logging.CRITICAL)
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
import vllm.tool_parsers  # noqa: F401 - registers the parsers

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
tokenizer.add_special_tokens(
    {"additional_special_tokens": ["<|python_tag|>", "<tool_call>", "</tool_call>"]})
request = ChatCompletionRequest(
    model="x", messages=[{"role": "user", "content": "hi"}],
    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
out = []
for name, text in json.load(sys.stdin):
    info = ToolParserManager.get_tool_parser(name)(tokenizer).extract_tool_calls(text, request)
    out.append({"calls": [[c.function.name, c.function.arguments] for c in info.tool_calls],
                "content": info.content})
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="a Python that imports vllm")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    args = parser.parse_args()

    from pipeline.serve.http.tool_parsers import TOOL_PARSERS
    from tests.serve.test_tool_parsers import CASES

    texts = [[name, text] for name, text, _, _ in CASES]
    done = subprocess.run(
        [args.vllm_python, "-c", VLLM_SIDE, args.tokenizer],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"vLLM's side failed: {done.stderr.strip().splitlines()[-1]}")
    differ = 0
    for (name, text), theirs in zip(texts, json.loads(done.stdout)):
        extracted = TOOL_PARSERS[name]().extract(text)
        ours = {
            "calls": [[c.name, c.arguments] for c in extracted.calls],
            "content": extracted.content,
        }
        same = ours == theirs
        differ += not same
        print(f"{'SAME' if same else 'DIFF'} {name:12s} {text[:60]!r}")
        if not same:
            print(f"  pipe {ours}\n  vLLM {theirs}")
    print(f"{len(texts) - differ} of {len(texts)} cases equal vLLM's")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
