"""`pipe preprocess`: stream inputs through the tokenizer into one Megatron indexed dataset per
JSON key, in input order, with a provenance manifest.

Overlapped: the main thread reads, hashes and writes while `--workers` others encode. With
gigatoken on Linux these are processes forked once the tokenizer is loaded, each parsing and
encoding whole batches (the main process takes a batch too when all are busy); elsewhere the
main thread also parses, and threads run the engine, which releases the GIL (with gigatoken each
thread encodes a batch of its own; another engine spreads each batch over its own pool). At most
a few batches are in flight, so memory stays bounded whatever the input size.
Every output is written under a temporary name and renamed at the end, so an interrupted run
leaves no final-named file; SIGTERM is turned into a clean exit so that the temporary files are
removed too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.data.indexed import (
    IndexedDatasetWriter,
    bin_path,
    dataset_exists,
    idx_path,
    optimal_dtype,
)
from pipeline.data.manifest import manifest_path
from pipeline.data.manifest import read as read_manifest
from pipeline.data.sources import SourcesWriter
from pipeline.preprocess import forked
from pipeline.preprocess import manifest as manifest_io
from pipeline.preprocess.chat import INPUT_KEYS, MASK_KEY, TOKENS_KEY, ChatEncoder, ChatSetup
from pipeline.preprocess.encode import BadLine, DocumentEncoder, EncodedBatch, EncodeOptions
from pipeline.preprocess.inputs import InputError, InputFile, InputRange, resolve_inputs
from pipeline.preprocess.preference import INPUT_KEYS as PREFERENCE_INPUT_KEYS
from pipeline.preprocess.preference import OUTPUT_KEYS as PREFERENCE_OUTPUT_KEYS
from pipeline.preprocess.preference import PreferenceEncoder
from pipeline.preprocess.progress import Progress
from pipeline.preprocess.readers import iter_batches, streams_hash
from pipeline.preprocess.shards import ShardSpec, describe_ranges, plan_shards, shard_prefix
from pipeline.tokenizer.engines import POOL, SHARED
from pipeline.tokenizer.tokenizer import TextTokenizer

MAX_REPORTED_BAD_LINES = 10


class PreprocessError(RuntimeError):
    """The run stopped on bad input or refused to start; the message says where and why."""


@dataclass
class PreprocessConfig:
    """Everything `pipe preprocess` needs; field names follow Megatron's preprocess_data.py."""

    inputs: list[str]
    output_prefix: str
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1  # encoding threads
    skip_bad_lines: bool = False
    overwrite: bool = False
    record_sources: bool = False  # write {prefix}.sources beside each .bin/.idx
    batch_bytes: int = 1 << 20  # small enough that no worker is left long with the last one
    log_interval: float = 10.0
    show_progress: bool = True
    shard: ShardSpec | None = None  # None: the whole input; see pipeline.preprocess.shards
    chat: ChatSetup | None = None  # --chat: conversations to tokens + loss mask (json_keys unused)
    preference: bool = False  # --preference (with chat): chosen/rejected pairs, two chat outputs

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The keys (columns) read from each record."""
        if self.chat is not None:
            return PREFERENCE_INPUT_KEYS if self.preference else INPUT_KEYS
        return tuple(self.json_keys)

    @property
    def output_keys(self) -> tuple[str, ...]:
        """One output dataset per key: `{prefix}_{key}_document`."""
        if self.chat is not None:
            return PREFERENCE_OUTPUT_KEYS if self.preference else (TOKENS_KEY, MASK_KEY)
        return tuple(self.json_keys)


@dataclass
class KeyOutput:
    key: str
    prefix: str
    dtype: str
    documents: int = 0
    sequences: int = 0
    tokens: int = 0


@dataclass
class PreprocessSummary:
    outputs: list[KeyOutput]
    documents: int = 0
    blank_lines: int = 0
    bad_lines: int = 0
    bad_line_examples: list[BadLine] = field(default_factory=list)
    input_bytes: int = 0
    text_bytes: int = 0
    elapsed: float = 0.0
    manifest: str = ""
    shard_note: str = ""  # "shard 3 of 7 (from ...): ..." for a sharded run
    already_complete: bool = False  # a sharded re-run that found its shard finished
    loss_tokens: int | None = None  # --chat: tokens whose loss mask is 1


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's document-level naming: `{prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


def preprocess(config: PreprocessConfig, tokenizer: TextTokenizer) -> PreprocessSummary:
    """Run the whole job (or, with `config.shard`, one shard of it) and return its counts;
    raises PreprocessError on bad input. A shard whose manifest says it is complete with the
    same tokenizer, flags, inputs and ranges is not run again."""
    inputs = resolve_inputs(config.inputs)
    shard = config.shard
    if shard is None:
        parts, prefix = [InputRange.whole(f) for f in inputs], config.output_prefix
    else:
        parts = plan_shards(inputs, shard.count)[shard.index]
        prefix = shard_prefix(config.output_prefix, shard.index, shard.count)
    dtype = optimal_dtype(tokenizer.vocab_size)
    dtypes = [dtype.name] * len(config.json_keys)
    if config.chat is not None:
        dtypes = [dtype.name if not _is_mask(k) else "uint8" for k in config.output_keys]
    summary = PreprocessSummary(
        [KeyOutput(k, output_prefix_for(prefix, k), d) for k, d in zip(config.output_keys, dtypes)]
    )
    manifest_file = manifest_path(prefix)
    summary.manifest = str(manifest_file)
    shard_info = None
    if shard is None:
        _refuse_existing([o.prefix for o in summary.outputs], manifest_file, config.overwrite)
    else:
        shard_info = manifest_io.shard_record(shard, config.output_prefix, inputs, parts)
        summary.shard_note = f"{shard} (from {shard.source}): {describe_ranges(parts)}"
        if _shard_already_complete(config, tokenizer, inputs, shard_info, summary):
            return summary
        if config.show_progress:
            print(summary.shard_note, file=sys.stderr, flush=True)
    try:
        _run(config, tokenizer, inputs, parts, dtype, summary, shard_info)
    except (PreprocessError, InputError) as e:
        if shard_info is not None:
            manifest_io.write(manifest_file, manifest_io.failed(shard_info, str(e)))
        raise
    return summary


def _run(
    config: PreprocessConfig,
    tokenizer: TextTokenizer,
    inputs: list[InputFile],
    parts: list[InputRange],
    dtype: np.dtype,
    summary: PreprocessSummary,
    shard_info: dict | None,
) -> None:
    """Read, encode and write `parts`, then the manifest (last, so that it marks completion)."""
    outputs = summary.outputs
    encoder = _encoder(config, tokenizer, dtype)  # validates options before any work starts
    total_bytes = sum(p.size for p in parts)
    progress = Progress(total_bytes, log_interval=config.log_interval, enabled=config.show_progress)
    token_outputs = [i for i, o in enumerate(outputs) if not (config.chat and _is_mask(o.key))]
    _set_engine_threads(config.workers)
    with ExitStack() as stack, _sigterm_as_exit():
        hashes = _InputHashes(parts)
        writers = [stack.enter_context(IndexedDatasetWriter(o.prefix, o.dtype)) for o in outputs]
        sources = []
        if config.record_sources:
            sources = [stack.enter_context(SourcesWriter(o.prefix)) for o in outputs]
        global_index = manifest_io.input_positions(inputs, parts)
        batches = iter_batches(
            parts,
            config.input_keys,
            batch_bytes=config.batch_bytes,
            max_batch_items=_MAX_BATCH_ITEMS,
            on_hashed=hashes.streamed.__setitem__,
        )
        try:
            # An input of one batch gets one worker: nothing to share, and no process to start.
            workers = 1 if _fits_one_batch(parts, config.batch_bytes) else config.workers
            for result in _encoded(batches, encoder, workers):
                _write(result, writers, outputs, summary, config.skip_bad_lines)
                for writer in sources:
                    writer.add(global_index[result.part], result.lines)
                progress.update(
                    documents=result.documents,
                    input_bytes=result.input_bytes,
                    text_bytes=result.text_bytes,
                    tokens=sum(len(result.keys[i].tokens) for i in token_outputs),
                )
        finally:
            progress.close()
        for writer in sources:
            writer.finalize()
        for writer, out in zip(writers, outputs):
            out.sequences = writer.num_sequences
            writer.finalize()
        summary.elapsed = progress.elapsed
        summary.input_bytes, summary.text_bytes = progress.input_bytes, progress.text_bytes
        record = manifest_io.build(config, tokenizer, inputs, hashes.result(), summary, shard_info)
        manifest_io.write(Path(summary.manifest), record)


def _encoder(config: PreprocessConfig, tokenizer: TextTokenizer, dtype: np.dtype):
    """The chat encoder for --chat, else the document encoder for config.json_keys."""
    if config.chat is not None:
        if config.append_eod or tokenizer.add_special_tokens:
            raise PreprocessError(
                "--chat encodes the rendered conversation as it stands (the template writes its "
                "special tokens): drop --append-eod and --add-special-tokens"
            )
        kind = PreferenceEncoder if config.preference else ChatEncoder
        return kind(tokenizer, config.chat.template, config.chat.rule, dtype.name)
    options = EncodeOptions(tuple(config.json_keys), config.append_eod, dtype.name)
    return DocumentEncoder(tokenizer, options)


def _shard_already_complete(
    config: PreprocessConfig,
    tokenizer: TextTokenizer,
    inputs: list[InputFile],
    shard_info: dict,
    summary: PreprocessSummary,
) -> bool:
    """True when this shard's manifest says it finished with the same tokenizer, flags, inputs
    and ranges, and its outputs are there: the re-run is a no-op (files untouched).

    A manifest left by a failed attempt lets the shard run again; a finished shard made
    differently is refused unless --overwrite."""
    manifest_file = Path(summary.manifest)
    prefixes = [o.prefix for o in summary.outputs]
    existing = read_manifest(manifest_file)
    if existing is not None and existing.get("complete") is False:
        return False  # a failed attempt: run it again, replacing whatever it left
    if existing is not None and all(dataset_exists(p) for p in prefixes):
        expected = manifest_io.identity(
            {
                "tokenizer": tokenizer.fingerprint(),
                "flags": manifest_io.flags(config, tokenizer),
                "inputs": manifest_io.input_entries(inputs),
                "shard": shard_info,
            }
        )
        found = manifest_io.identity(existing)
        if found == expected and not config.overwrite:
            summary.already_complete = True
            summary.shard_note = (
                f"shard {shard_info['index']} of {shard_info['count']} already complete "
                f"({manifest_file}): nothing to do"
            )
            _copy_counts(existing, summary)
            return True
        if found != expected and not config.overwrite:
            differ = ", ".join(k for k in expected if expected[k] != found.get(k))
            raise PreprocessError(
                f"{manifest_file}: shard {shard_info['index']} of {shard_info['count']} exists "
                f"but was made with a different {differ}; pass --overwrite to replace it"
            )
    _refuse_existing(prefixes, manifest_file, config.overwrite)
    return False


def _copy_counts(record: dict, summary: PreprocessSummary) -> None:
    """Fill a skipped shard's summary from its manifest."""
    for out in summary.outputs:
        recorded = record.get("outputs", {}).get(out.key, {})
        out.documents = recorded.get("documents", 0)
        out.sequences = recorded.get("sequences", 0)
        out.tokens = recorded.get("tokens", 0)
    counts = record.get("counts", {})
    summary.documents = counts.get("documents", 0)
    summary.text_bytes = counts.get("text_bytes", 0)
    summary.input_bytes = counts.get("input_bytes", 0)
    summary.loss_tokens = counts.get("loss_tokens")


def _write(
    result: EncodedBatch,
    writers: list[IndexedDatasetWriter],
    outputs: list[KeyOutput],
    summary: PreprocessSummary,
    skip_bad_lines: bool,
) -> None:
    fatal = next((b for b in result.bad_lines if b.fatal), None)
    if fatal is not None:
        raise PreprocessError(str(fatal))
    if result.bad_lines:
        if not skip_bad_lines:
            raise PreprocessError(
                f"{result.bad_lines[0]} (use --skip-bad-lines to skip such lines and go on)"
            )
        summary.bad_lines += len(result.bad_lines)
        room = MAX_REPORTED_BAD_LINES - len(summary.bad_line_examples)
        summary.bad_line_examples.extend(result.bad_lines[:room])
    summary.documents += result.documents
    summary.blank_lines += result.blank_lines
    for writer, out, encoded in zip(writers, outputs, result.keys):
        writer.add_documents(
            encoded.tokens, encoded.sequence_lengths, encoded.sequences_per_document
        )
        out.documents += len(encoded.sequences_per_document)
        out.tokens += len(encoded.tokens)
    masks = [k for o, k in zip(outputs, result.keys) if _is_mask(o.key)]
    if masks:
        ones = sum(int(np.count_nonzero(k.tokens)) for k in masks)
        summary.loss_tokens = (summary.loss_tokens or 0) + ones


def _is_mask(key: str) -> bool:
    """A chat run's loss-mask output (`messages_loss_mask`, `chosen_loss_mask`, ...)."""
    return key.endswith("_loss_mask")


def _refuse_existing(prefixes: list[str], manifest_path: Path, overwrite: bool) -> None:
    candidates = [p for prefix in prefixes for p in (bin_path(prefix), idx_path(prefix))]
    existing = [p for p in candidates if p.exists()]
    if manifest_path.exists():
        existing.append(manifest_path)
    if existing and not overwrite:
        names = ", ".join(str(p) for p in existing[:4])
        raise PreprocessError(f"output exists: {names}; pass --overwrite to replace it")


# --------------------------------------------------------------------------------- encoding

# Batches parsed ahead of the one being written, beyond one per encoding thread: enough to keep
# the engine busy while the main thread parses and writes, few enough that memory does not
# depend on the input.
_LOOKAHEAD = 3
# Documents per batch at most (batches are mostly cut by config.batch_bytes).
_MAX_BATCH_ITEMS = 16384


def _fits_one_batch(parts: list[InputRange], batch_bytes: int) -> bool:
    """Whether the input is known to fit in one batch (a pipe's size is not known)."""
    paths = [Path(p.file.path) for p in parts]
    if any(path.is_fifo() or path.is_char_device() for path in paths):
        return False
    return sum(p.size for p in parts) <= batch_bytes


def _set_engine_threads(workers: int) -> None:
    """Size the engines' thread pools (gigatoken's and tokenizers' Rust pools read these when
    first used; a pool already started in this process keeps its size)."""
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    os.environ["RAYON_RS_NUM_CPUS"] = str(workers)  # tokenizers' own name for it


def _encoded(batches: Iterable, encoder: DocumentEncoder, workers: int) -> Iterator[EncodedBatch]:
    """Encoded batches in input order: from forked encoding processes where the engine allows
    it (pipeline.preprocess.forked), else from threads of this process."""
    if workers > 1 and encoder.tokenizer.forks and forked.can_fork():
        try:
            yield from forked.encode_forked(batches, encoder, workers)
        except forked.EncoderDied as e:
            raise PreprocessError(str(e)) from None
    else:
        yield from _encode_in_order(batches, encoder, workers)


def _encode_in_order(
    batches: Iterable, encoder: DocumentEncoder, workers: int
) -> Iterator[EncodedBatch]:
    """Encoded batches in input order: the main thread parses the next batches while encoding
    threads run the engine on earlier ones.

    An engine that encodes on the calling thread (gigatoken) gets `workers` threads (more than
    one), each on a batch of its own: no thread waits for another's batch to finish, as the
    threads of one engine pool spreading each batch do. Otherwise one thread runs the engine,
    which spreads each batch over its own pool."""
    serial = encoder.tokenizer.serial_batches and workers > 1
    threads = workers if serial else 1
    where = SHARED if serial else POOL
    pending: deque = deque()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="pipe-encode")
    try:
        for batch in batches:
            parsed = encoder.parse(batch)
            pending.append((parsed, pool.submit(encoder.encode, parsed, where)))
            if len(pending) > _LOOKAHEAD + threads - 1:
                parsed, future = pending.popleft()
                yield encoder.pack(parsed, future.result())
        while pending:
            parsed, future = pending.popleft()
            yield encoder.pack(parsed, future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _InputHashes:
    """SHA-256 of every part, for the manifest, without a second pass where avoidable: whole
    JSONL files are hashed by the reader as it reads them (`streamed`, filled through
    iter_batches' on_hashed); other parts (ranges, tabular files) by a background thread."""

    def __init__(self, parts: list[InputRange]) -> None:
        self.parts = parts
        self.streamed: dict[int, str] = {}
        self._others = _in_background(
            manifest_io.hash_inputs, [p for p in parts if not streams_hash(p)]
        )

    def result(self) -> list[str]:
        others = iter(self._others.result())
        return [
            self.streamed[i] if streams_hash(p) else next(others) for i, p in enumerate(self.parts)
        ]


def _in_background(fn: Callable, *args) -> Future:
    """Run `fn` in a daemon thread: an interrupted run exits without waiting for it (hashing a
    large input would otherwise hold up Ctrl-C)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever reads the result
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="pipe-hash-inputs").start()
    return future


@contextmanager
def _sigterm_as_exit():
    """Turn SIGTERM into SystemExit so that context managers remove temporary files."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def format_summary(summary: PreprocessSummary) -> list[str]:
    """Human-readable closing lines: one summary line plus bad-line reports and output paths."""
    rate = summary.text_bytes / max(summary.elapsed, 1e-9) / 1e6
    token_outputs = summary.outputs
    if summary.loss_tokens is not None:
        token_outputs = [o for o in summary.outputs if not _is_mask(o.key)]
    tokens = sum(o.tokens for o in token_outputs)
    if summary.already_complete:
        return [summary.shard_note]
    lines = [summary.shard_note] if summary.shard_note else []
    lines += [
        f"done: {summary.documents:,} documents, {tokens:,} tokens, "
        f"{summary.text_bytes / 1e6:,.1f} MB in {summary.elapsed:.1f}s ({rate:,.1f} MB/s, "
        f"{tokens / max(summary.elapsed, 1e-9):,.0f} tokens/s)"
    ]
    if summary.loss_tokens is not None:
        share = 100 * summary.loss_tokens / max(tokens, 1)
        lines.append(f"loss mask: {summary.loss_tokens:,} tokens trained on ({share:.1f}%)")
    if summary.blank_lines:
        lines.append(f"skipped {summary.blank_lines:,} blank lines")
    if summary.bad_lines:
        lines.append(f"skipped {summary.bad_lines:,} bad lines, first ones:")
        lines += [f"  {b}" for b in summary.bad_line_examples]
    for out in summary.outputs:
        lines.append(
            f"wrote {out.prefix}.bin/.idx ({out.dtype}, {out.documents:,} documents, "
            f"{out.sequences:,} sequences, {out.tokens:,} tokens)"
        )
    lines.append(f"manifest {summary.manifest}")
    return lines
