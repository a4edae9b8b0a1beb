"""Grammar engines for structured output, measured on this CPU: xgrammar (vLLM's default),
llguidance and outlines-core, on the same JSON schema and tokenizers.

For each engine and tokenizer it prints: the one-off tokenizer preparation (per server), the
schema's compile time (no cache; llguidance compiles lazily, so its figure is the matcher's
construction plus its first mask), and the per-token cost of constrained decoding: fill the
token bitmask and accept the token, averaged over the tokens of a JSON instance of the schema,
best of the runs (the apply step, pipe's own `masked`, is timed once for all). Two
tokenizers: a tiny byte-level BPE (600 tokens, the tests' kind, trained here) and Llama 3's
(128,256 tokens, from the shared data folder). Then pipe's engine on a random Llama-shaped model
over the larger tokenizer: ms per decode step with every row plain, and with half the rows held
to the schema in the same batch, and from those the cost per constrained token.

    pip install xgrammar llguidance outlines-core   # xgrammar: --no-deps, then apache-tvm-ffi
    python scripts/bench/grammar_engines.py [--llama3 DIR] [--repeat 5] [--engines llguidance]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("PIPE_BENCH_DATA", ROOT.parent / "shared" / "data"))

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "kind": {"enum": ["file", "directory", "link"]},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "owner": {
            "type": "object",
            "properties": {"uid": {"type": "integer"}, "login": {"type": "string"}},
            "required": ["uid", "login"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "kind", "score", "tags", "owner"],
    "additionalProperties": False,
}
INSTANCE = {
    "id": 4312,
    "name": "Kernel",
    "kind": "directory",
    "score": 3.25,
    "tags": ["linux docs", "memory manager", "scheduler"],
    "owner": {"uid": 1000, "login": "torvalds"},
}


def tiny_tokenizer(directory: Path) -> Path:
    """The tests' kind of tokenizer: byte-level BPE of 600 tokens in Llama 3's style."""
    from pipeline.examples.stdlib_corpus import train_tokenizer

    texts = [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(500)]
    texts += [json.dumps(INSTANCE)] * 5
    return train_tokenizer(texts, directory, vocab_size=600) / "tokenizer.json"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def per_token(fill_apply_accept, tokens: list[int], repeat: int) -> float:
    """Mean seconds per token of `fill_apply_accept(token)` over the instance, best of runs."""
    runs = []
    for _ in range(repeat):
        step = fill_apply_accept()
        start = time.perf_counter()
        for token in tokens:
            step(token)
        runs.append((time.perf_counter() - start) / len(tokens))
    return min(runs)


def bench_xgrammar(path: Path, vocab: int, eos: int, tokens: list[int], repeat: int) -> dict:
    import xgrammar as xgr

    text = path.read_text()

    def prepare():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(text)
        encoded = [tok.id_to_token(i) or "" for i in range(vocab)]
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
        return xgr.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=vocab,
            stop_token_ids=[eos],
            add_prefix_space=meta["add_prefix_space"],
        )

    info, prep = timed(prepare)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schema = json.dumps(SCHEMA)
    compiles = [
        timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False))[1]
        for _ in range(repeat)
    ]
    grammar = compiler.compile_json_schema(schema, any_whitespace=False)

    def fresh():
        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, vocab)

        def step(token):
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(token), token

        return step

    return {"prepare": prep, "compile": min(compiles), "token": per_token(fresh, tokens, repeat)}


def bench_llguidance(path: Path, vocab: int, eos: int, tokens: list[int], repeat: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    text = path.read_text()
    tok, prep = timed(lambda: llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA,
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
    mask = llt.allocate_token_bitmask(1, vocab)

    def compile_once():
        matcher = llguidance.LLMatcher(tok, grammar)
        llt.fill_next_token_bitmask(matcher, mask, 0)
        assert not matcher.is_error(), matcher.get_error()

    compiles = [timed(compile_once)[1] for _ in range(repeat)]

    def fresh():
        matcher = llguidance.LLMatcher(tok, grammar)

        def step(token):
            llt.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(token), matcher.get_error()

        return step

    return {"prepare": prep, "compile": min(compiles), "token": per_token(fresh, tokens, repeat)}


def bench_outlines(path: Path, vocab: int, eos: int, tokens: list[int], repeat: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels import torch as okt
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))

    def prepare():
        byte_of = {c: b for b, c in _byte_level_alphabet().items()}
        table: dict[bytes, list[int]] = {}
        for i in range(tok.get_vocab_size()):
            piece = tok.id_to_token(i)
            if i == eos or piece is None or piece.startswith("<|"):
                continue
            table.setdefault(bytes(byte_of[c] for c in piece), []).append(i)
        return Vocabulary(eos, table)

    vocabulary, prep = timed(prepare)
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r" ?")
    compiles = [timed(lambda: Index(regex, vocabulary))[1] for _ in range(min(repeat, 2))]
    index = Index(regex, vocabulary)

    def fresh():
        guide = Guide(index)
        mask = okt.allocate_token_bitmask(vocab)

        def step(token):
            okt.fill_next_token_bitmask(guide, mask)
            if token != eos:  # a final state takes no EOS transition in outlines-core's index
                guide.advance(token)

        return step

    return {"prepare": prep, "compile": min(compiles), "token": per_token(fresh, tokens, repeat)}


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's token spelling)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def masked_cost(vocab: int, rows: int, repeat: int) -> float:
    """Seconds to apply a bitmask to `rows` rows of logits with pipe's `masked`."""
    import torch

    from pipeline.serve.engine.structured_output import masked

    logits = torch.randn(rows, vocab)
    # a JSON structure state: a few allowed tokens (random bits would cost ~3x more, by the
    # CPU's mispredicted branches, but no grammar state looks like that)
    bitmask = torch.zeros(rows, -(-vocab // 32), dtype=torch.int32)
    bitmask[:, :3] = -1
    runs = []
    for _ in range(repeat * 10):
        start = time.perf_counter()
        masked(logits, bitmask)
        runs.append(time.perf_counter() - start)
    return min(runs)


def engine_cost(tokenizer: Path, args: argparse.Namespace) -> None:
    """ms per decode step of pipe's engine on a random Llama-shaped model over `tokenizer`: a
    batch of plain rows, then the same batch with half its rows held to `SCHEMA`; the extra time
    over the constrained row-steps is the cost per constrained token."""
    import shutil

    import torch

    from pipeline.common.quiet import import_transformers
    from pipeline.serve.engine.core import Engine
    from pipeline.serve.engine.loading import open_generator
    from pipeline.serve.engine.sampling import SamplingParams
    from pipeline.serve.engine.structured_output import GrammarBackend, StructuredOutput

    transformers = import_transformers()
    with tempfile.TemporaryDirectory() as directory:
        vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
        vocab_size = len(vocab) + 256
        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            eos_token_id=None,
            bos_token_id=None,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        shutil.copy(tokenizer, Path(directory) / "tokenizer.json")
        gen = open_generator(directory)
        grammars = GrammarBackend.from_path(tokenizer, vocab_size, gen.eos_ids)
    prompt = gen.tokenizer.encode_batch(["line 3: value"])[0]
    schema = StructuredOutput.json_schema(SCHEMA)
    batch, steps = args.batch, args.steps
    timings = {}
    for label, constrained in (("plain", 0), ("mixed", batch // 2)):
        best = float("inf")
        for _ in range(args.repeat):
            engine = Engine(gen.model, max_batch=batch, cache_blocks=4096, grammars=grammars)
            for row in range(batch):  # no stop token: every row runs all the steps
                structured = schema if row < constrained else None
                engine.add(
                    prompt,
                    SamplingParams(
                        max_new_tokens=steps + 1, seed=row, structured_output=structured
                    ),
                )
            engine.step()  # the prefill, and each matcher's first mask
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            best = min(best, (time.perf_counter() - start) / steps)
        timings[label] = best
    extra = (timings["mixed"] - timings["plain"]) / (batch // 2)
    print(
        f"engine, vocab {vocab_size}, {args.layers} layers x {args.hidden}, batch {batch}, "
        f"{steps} decode steps (best of {args.repeat}):"
    )
    print(
        f"  ms/step all plain: {timings['plain'] * 1e3:.2f}; half the rows held to the "
        f"schema: {timings['mixed'] * 1e3:.2f}"
    )
    print(
        f"  ms per token: plain row {timings['plain'] / batch * 1e3:.3f}, constrained row "
        f"{(timings['plain'] / batch + extra) * 1e3:.3f} (+{extra * 1e3:.3f})"
    )


ENGINES = {
    "xgrammar": bench_xgrammar,
    "llguidance": bench_llguidance,
    "outlines-core": bench_outlines,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama3", type=Path, default=DATA / "tokenizers" / "llama3")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--batch", type=int, default=16, help="engine rows (half constrained)")
    parser.add_argument("--steps", type=int, default=32, help="engine decode steps timed")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        paths = {"tiny (600)": tiny_tokenizer(Path(scratch))}
        if (args.llama3 / "tokenizer.json").is_file():
            paths["llama3 (128256)"] = args.llama3 / "tokenizer.json"
        else:
            print(f"{args.llama3}: no tokenizer.json; Llama 3 skipped (--llama3 DIR)")
        instance = json.dumps(INSTANCE, separators=(", ", ": "))
        print(f"schema: {len(json.dumps(SCHEMA))} bytes; instance: {len(instance)} bytes")
        print(
            f"{'tokenizer':16} {'engine':14} {'prepare s':>10} {'compile ms':>11} {'us/token':>9}"
        )
        for label, path in paths.items():
            tok = Tokenizer.from_file(str(path))
            vocab = tok.get_vocab_size()
            eos = tok.token_to_id("<|end_of_text|>")
            tokens = tok.encode(instance, add_special_tokens=False).ids + [eos]
            for name in args.engines.split(","):
                row = ENGINES[name](path, vocab, eos, tokens, args.repeat)
                print(
                    f"{label:16} {name:14} {row['prepare']:10.2f} {row['compile'] * 1e3:11.1f} "
                    f"{row['token'] * 1e6:9.1f}"
                )
            apply = masked_cost(vocab, 1, args.repeat)
            print(f"{label:16} {'apply (pipe)':14} {'':10} {'':11} {apply * 1e6:9.1f}")
        engine_cost(paths[list(paths)[-1]], args)


if __name__ == "__main__":
    main()
