"""vLLM's GET /tokenizer_info: the served tokenizer's configuration, as tokenizer_config.json
holds it, so a client (lm-evaluation-harness's remote tokenizer) needs no copy of the files.

The shape is vLLM's: the configuration's entries with each special token as its text (an
AddedToken object becomes its `content`), without the vocabulary file paths, plus
`tokenizer_class` and the chat template. `eos_token` and `bos_token` are always there (null when
the tokenizer has none): the harness reads `eos_token` to tell a server with this route.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from pipeline.tokenizer.chat_template import ChatTemplateError, special_tokens

_CLASS_BY_KIND = {
    "hf": "PreTrainedTokenizerFast",
    "sentencepiece": "LlamaTokenizer",
    "gpt2": "GPT2TokenizerFast",
}


def tokenizer_info(path: str | Path, tokenizer, template) -> dict[str, Any]:
    """The /tokenizer_info body of `tokenizer` (a `TextTokenizer`), loaded from `path` (its
    directory or a file in it), with `template` (a `ChatTemplate` or None)."""
    directory = Path(path)
    directory = directory if directory.is_dir() else directory.parent
    config_file = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}  # absent or unreadable: what the tokenizer itself tells is still served
    config = config if isinstance(config, dict) else {}
    info = {k: _plain(v) for k, v in config.items() if k not in ("vocab_file", "merges_file")}
    info |= special_tokens(directory, config)
    if info.get("eos_token") is None and tokenizer.eod is not None:
        info["eos_token"] = tokenizer.decode([tokenizer.eod])
    info.setdefault("eos_token", None)
    info.setdefault("bos_token", None)
    info.setdefault("tokenizer_class", _CLASS_BY_KIND.get(tokenizer.kind, _CLASS_BY_KIND["hf"]))
    if template is not None:
        # several templates and none the default: there is none to name
        with contextlib.suppress(ChatTemplateError):
            info["chat_template"] = template.source()
    return info


def _plain(value: Any) -> Any:
    """A configuration value with each AddedToken object (a dict with `content`) as its text."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
