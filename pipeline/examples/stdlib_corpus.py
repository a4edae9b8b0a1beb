"""The embedded default corpus and tokenizer: text every Python installation has.

`build_corpus` writes a JSONL file with one document per standard-library module: its module,
class and function docstrings, read with `ast` (no module is imported, so nothing runs).
`train_tokenizer` trains a small Llama-3-style byte-level BPE tokenizer on it with `tokenizers`.

    python -m pipeline.examples.stdlib_corpus --output runs/quickstart/data
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from pipeline.common.atomic import atomic_file, atomic_path, write_json

# Llama 3's pre-tokenizer split: contractions, letters, 1-3 digits, punctuation, whitespace.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, in a stable order (tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    return sorted(
        p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1])
    )


def module_text(path: Path) -> str:
    """A module's docstrings, module first, each headed by its qualified name."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for name, node in _documented(tree, ""):
        doc = ast.get_docstring(node)
        if doc:
            parts.append(f"{name}\n{doc}" if name else doc)
    return "\n\n".join(parts)


def _documented(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    yield prefix, node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _documented(
                child, f"{prefix}{child.name}" if not prefix else f"{prefix}.{child.name}"
            )


def build_corpus(output: str | os.PathLike, max_documents: int | None = None) -> int:
    """Write the corpus as JSONL ({"id", "text"}); returns the number of documents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    with atomic_file(output, "w", encoding="utf-8") as f:
        for path in stdlib_sources():
            text = module_text(path)
            if not text:
                continue
            record = {"id": str(path.relative_to(root)), "text": text}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
            if max_documents is not None and count >= max_documents:
                break
    return count


def iter_texts(corpus: str | os.PathLike) -> Iterator[str]:
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_tokenizer(
    texts: Iterator[str] | list[str],
    output_dir: str | os.PathLike,
    vocab_size: int = 8192,
    pre_tokenizer: object | None = None,
) -> Path:
    """Train a byte-level BPE tokenizer in Llama 3's style (same split regex, BOS/EOS specials)
    and save `tokenizer.json` + `tokenizer_config.json` (with a chat template, for fine-tuning:
    `stdlib_chat`); returns the directory. `pre_tokenizer` (a `tokenizers` pre-tokenizer)
    replaces Llama 3's split, e.g. to keep every digit a token of its own."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    output_dir = Path(output_dir)
    with atomic_path(output_dir / "tokenizer.json") as temporary:
        tokenizer.save(str(temporary))
    from pipeline.examples.stdlib_chat import CHAT_TEMPLATE

    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(output_dir / "tokenizer_config.json", config)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory for corpus and tokenizer")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-documents", type=int, default=None)
    args = parser.parse_args()
    out = Path(args.output)
    corpus = out / "stdlib_docs.jsonl"
    n = build_corpus(corpus, args.max_documents)
    print(f"corpus: {n} documents from the standard library's docstrings -> {corpus}")
    tokenizer_dir = train_tokenizer(iter_texts(corpus), out / "tokenizer", args.vocab_size)
    print(f"tokenizer: byte-level BPE, vocab {args.vocab_size} -> {tokenizer_dir}/tokenizer.json")


if __name__ == "__main__":
    main()
