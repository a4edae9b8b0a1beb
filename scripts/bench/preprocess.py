"""`pipe preprocess` end to end against gigatoken's own limit, measured in one run.

Baselines, each timed in the same run, alternating with pipe so that machine load hits all alike:
- gigatoken's own `Tokenizer(path)` + `encode_files(JsonlFileSource)` of the plain JSONL file,
  timed inside a fresh process (no interpreter start counted; the whole file's tokens in memory);
- the `tokenizers` in-memory limit: `encode_batch` of texts already parsed, on all cores.
`pipe preprocess --append-eod` is timed as a user runs it: process start, tokenizer load (with
its proof cached by an earlier run), reading, parsing, encoding, writing `.bin/.idx` and the
manifest. Start-up (command to first batch beyond the tokenizer load) is measured on a
one-line input, with the engine proof cached and not.

Input: $PIPE_BENCH_DATA/corpus/linux_docs.jsonl.zst (unique text), decompressed for the plain-JSONL
case. `--memory-gb N` also runs pipe on the corpus concatenated to N GB, for peak memory only.

`--chat` measures `pipe preprocess --chat` instead, against plain preprocess of the same text
in the same run (target: at least half its MB/s): each corpus document becomes one conversation
of its paragraphs, grouped into 2, 4, 6 or 8 alternating user/assistant turns (a document of one
paragraph is cut in two), and the plain input holds each conversation's turns joined by blank
lines. Chat runs with the tokenizer's own template (Llama 3's, unmarked: the rendered-prefix
mask rule) and with a copy marked with {% generation %} (the generation rule).

On a shared machine, `--quiet-wait S` waits up to S seconds before each timed run for no other
task to be runnable, and says how many runs started that way. Python caches compiled modules as
it does for a user (in the run's temporary directory), whatever PYTHONDONTWRITEBYTECODE says.

    python scripts/bench/preprocess.py [--workers 2] [--repeat 3] [--memory-gb 1] [--quiet-wait 60]
    python scripts/bench/preprocess.py --chat [--workers 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The benchmark corpora and tokenizers: a folder with corpus/ and tokenizers/ (PIPE_BENCH_DATA).
SHARED = Path(os.environ.get("PIPE_BENCH_DATA", ROOT.parent / "shared" / "data"))
CORPUS = SHARED / "corpus" / "linux_docs.jsonl.zst"
TARGET_VS_GIGATOKEN = 1.33  # pipe wall / gigatoken load + encode_files
TARGET_ZST_VS_PLAIN = 1.2
TARGET_STARTUP_S = 0.3
TARGET_RSS_MIB = 1024
TARGET_CHAT_VS_PLAIN = 0.5  # chat MB/s / plain MB/s on the same text
# Llama 3's template with the assistant's text and end-of-turn marker in {% generation %}.
LLAMA3_MARKED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' %}"
    "{% if loop.index0 == 0 %}{% set header = bos_token + header %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ header }}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ header + message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
LIBRARY_SAMPLE_MB = 10

_GIGATOKEN = (
    "import sys, time, gigatoken; t = time.perf_counter(); "
    "tok = gigatoken.Tokenizer(sys.argv[1]); "
    "ids = tok.encode_files(gigatoken.JsonlFileSource([sys.argv[2]])); "
    "print(time.perf_counter() - t, int(ids.layout.offsets.data[-1]))"
)
MEASURED_RUN = Path(__file__).with_name("measured_run.py")  # wall seconds, peak RSS
_LOAD = (
    "import sys, time; from pipeline.tokenizer.tokenizer import load_tokenizer; "
    "t = time.perf_counter(); load_tokenizer(sys.argv[1]); print(time.perf_counter() - t)"
)


class Quiet:
    """Waits, before a timed run, for a moment when no other task is runnable (the 4th field of
    /proc/loadavg counts runnable tasks, the reader included), and counts the runs that got one."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s, self.quiet, self.runs = wait_s, 0, 0

    def wait(self) -> None:
        if self.wait_s <= 0:
            return
        self.runs += 1
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if _stays_quiet(checks=5, every_s=0.2):
                self.quiet += 1
                return
            time.sleep(0.5)

    def note(self) -> str:
        if self.wait_s <= 0:
            return "runs not timed for quiet moments (see --quiet-wait)"
        return f"{self.quiet} of {self.runs} timed runs started with no other task runnable"


def _stays_quiet(checks: int, every_s: float) -> bool:
    for _ in range(checks):
        if _others_runnable() > 0:
            return False
        time.sleep(every_s)
    return True


def _others_runnable() -> int:
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1
    except (OSError, IndexError, ValueError):
        return 0


QUIET = Quiet(0)


def gigatoken_limit(tokenizer_json: Path, plain: Path) -> tuple[float, int]:
    """Seconds of gigatoken's own load + encode_files in a fresh process, and its token count."""
    QUIET.wait()
    out = subprocess.run(
        [sys.executable, "-c", _GIGATOKEN, str(tokenizer_json), str(plain)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), int(out[1])


def tokenizers_limit(tokenizer_json: Path, texts: list[str]) -> float:
    """MB/s of tokenizers' encode_batch over texts in memory, on all cores (on the first
    LIBRARY_SAMPLE_MB of text: the whole corpus takes minutes)."""
    from tokenizers import Tokenizer

    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text.encode("utf-8"))
        if size >= LIBRARY_SAMPLE_MB * 1e6:
            break
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_batch(sample[:50], add_special_tokens=False)  # warm the thread pool
    start = time.perf_counter()
    tok.encode_batch(sample, add_special_tokens=False)
    return size / 1e6 / (time.perf_counter() - start)


def run_pipe(
    src: Path,
    tokenizer_dir: Path,
    out: Path,
    workers: int,
    env: dict,
    tree: bool = False,
    flags: tuple[str, ...] = ("--append-eod",),
) -> tuple:
    """Wall seconds of `pipe preprocess --append-eod` (or other `flags`) end to end, peak RSS
    (KiB: of the largest process, or with `tree` of all its processes summed), manifest."""
    cmd = [sys.executable, "-m", "pipeline", "preprocess", "--input", str(src)]
    cmd += ["--tokenizer", str(tokenizer_dir), "--output-prefix", str(out), *flags]
    cmd += ["--workers", str(workers), "--overwrite", "--quiet"]
    QUIET.wait()
    with tempfile.TemporaryFile() as log:
        measured = [sys.executable, MEASURED_RUN, *(["--tree"] if tree else []), *cmd]
        launcher = subprocess.run(measured, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        if launcher.returncode != 0:
            log.seek(0)
            sys.exit(f"pipe preprocess failed:\n{log.read().decode(errors='replace')}")
    elapsed, rss = launcher.stdout.split()
    manifest = json.loads(Path(f"{out}.json").read_text())
    return float(elapsed), int(rss), manifest


def load_seconds(tokenizer_dir: Path, env: dict) -> float:
    QUIET.wait()
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tokenizer_dir)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return float(out.stdout.split()[-1])


def startup(name: str, tmp: Path, workers: int, env: dict) -> None:
    """Command to first batch beyond the tokenizer load: a one-line run minus the load."""
    tokenizer_dir = SHARED / "tokenizers" / name
    one = tmp / "one.jsonl"
    one.write_text('{"text": "hello"}\n')
    cold_env = dict(env, XDG_CACHE_HOME=str(tmp / f"cold-cache-{name}"))
    run_pipe(one, tokenizer_dir, tmp / "one", workers, env)  # compiles modules, proves the engine
    cold, _, _ = run_pipe(one, tokenizer_dir, tmp / "one", workers, cold_env)
    warm = statistics.median(
        run_pipe(one, tokenizer_dir, tmp / "one", workers, env)[0] for _ in range(3)
    )
    load = statistics.median(load_seconds(tokenizer_dir, env) for _ in range(3))
    extra = warm - load
    print(
        f"{name}: start-up: one-line run {warm:.2f} s, tokenizer load {load:.2f} s -> "
        f"{extra:.2f} s beyond the load (target <= {TARGET_STARTUP_S} s: "
        f"{'met' if extra <= TARGET_STARTUP_S else 'NOT met'}); first run ever (engine "
        f"self-test against the reference library, then cached): {cold:.2f} s"
    )


def bench(name: str, plain: Path, texts: list[str], mb: float, args, tmp: Path, env) -> bool:
    tokenizer_dir = SHARED / "tokenizers" / name
    run_pipe(plain, tokenizer_dir, tmp / name, args.workers, env)  # proves the engine once
    giga, plain_s, zst_s = [], [], []
    for _ in range(args.repeat):
        seconds, giga_tokens = gigatoken_limit(tokenizer_dir / "tokenizer.json", plain)
        giga.append(seconds)
        elapsed, rss, manifest = run_pipe(plain, tokenizer_dir, tmp / name, args.workers, env)
        plain_s.append(elapsed)
        zst_s.append(run_pipe(CORPUS, tokenizer_dir, tmp / f"{name}z", args.workers, env)[0])
    lib_rate = tokenizers_limit(tokenizer_dir / "tokenizer.json", texts)
    pipe_tokens = manifest["outputs"]["text"]["tokens"]
    documents = manifest["outputs"]["text"]["documents"]
    engine = manifest["tokenizer"]["engine"]
    g, p, z = (statistics.median(x) for x in (giga, plain_s, zst_s))
    ratio, zratio = p / g, z / p
    ok = ratio <= TARGET_VS_GIGATOKEN and zratio <= TARGET_ZST_VS_PLAIN
    print(
        f"{name}: {'tokenizers encode_batch, in memory (first 10 MB)':42s} "
        f"{'':8s} {lib_rate:7.1f} MB/s"
    )
    rows = [
        ("gigatoken load + encode_files", g),
        (f"pipe preprocess, plain .jsonl ({engine})", p),
        (f"pipe preprocess, .jsonl.zst ({engine})", z),
    ]
    for label, seconds in rows:
        print(f"{name}: {label:42s} {seconds:6.2f} s {mb / seconds:7.1f} MB/s")
    print(
        f"{name}: pipe / gigatoken = {ratio:.2f}x (target <= {TARGET_VS_GIGATOKEN}x), "
        f"zst / plain = {zratio:.2f}x (target <= {TARGET_ZST_VS_PLAIN}x): "
        f"{'met' if ok else 'NOT met'}; peak RSS {rss / 1024:,.0f} MiB (largest process); runs: "
        f"gigatoken {_fmt(giga)}, plain {_fmt(plain_s)}, zst {_fmt(zst_s)}"
    )
    # Same tokens as gigatoken plus one EOD per document: nothing dropped or added.
    assert pipe_tokens == giga_tokens + documents, (pipe_tokens, giga_tokens, documents)
    return ok


def memory(plain: Path, gb: float, workers: int, tmp: Path, env: dict) -> bool:
    """Peak RSS of pipe on the corpus concatenated to `gb` GB (memory only: repeated text)."""
    big = tmp / "big.jsonl"
    data = plain.read_bytes()
    with open(big, "wb") as f:
        for _ in range(int(gb * 1e9 / len(data)) + 1):
            f.write(data)
    size = big.stat().st_size / 1e9
    llama3 = SHARED / "tokenizers" / "llama3"
    elapsed, rss, _ = run_pipe(big, llama3, tmp / "big", workers, env, tree=True)
    big.unlink()
    ok = rss / 1024 < TARGET_RSS_MIB
    print(
        f"memory: {size:.2f} GB input (the corpus repeated, for memory only), llama3: peak RSS "
        f"of all its processes summed {rss / 1024:,.0f} MiB in {elapsed:.1f} s (target < "
        f"{TARGET_RSS_MIB} MiB: {'met' if ok else 'NOT met'})"
    )
    return ok


def conversation(index: int, text: str) -> list[dict]:
    """A document as one conversation: its paragraphs in 2, 4, 6 or 8 alternating user and
    assistant turns (by the document's index), or cut in two when it has one paragraph."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if len(paragraphs) < 2:
        cut = len(text) // 2
        turns = [text[:cut], text[cut:]]
    else:
        count = min(2 * (1 + index % 4), len(paragraphs) // 2 * 2)
        size, extra = divmod(len(paragraphs), count)
        bounds = [k * size + min(k, extra) for k in range(count + 1)]
        turns = ["\n\n".join(paragraphs[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [{"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(turns)]


def chat_inputs(texts: list[str], tmp: Path) -> tuple[Path, Path, float]:
    """The chat JSONL, the plain JSONL of the same text, and that text's size in MB."""
    chat, plain, size = tmp / "chat.jsonl", tmp / "chat_text.jsonl", 0
    with open(chat, "w", encoding="utf-8") as c, open(plain, "w", encoding="utf-8") as p:
        for index, text in enumerate(texts):
            messages = conversation(index, text)
            joined = "\n\n".join(m["content"] for m in messages)
            size += len(joined.encode("utf-8"))
            c.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            p.write(json.dumps({"text": joined}, ensure_ascii=False) + "\n")
    return chat, plain, size / 1e6


def bench_chat(name: str, texts: list[str], args, tmp: Path, env: dict) -> bool:
    """`pipe preprocess --chat` (both mask rules) against plain preprocess of the same text,
    alternating in one run; MB/s on the conversations' text."""
    tokenizer_dir = SHARED / "tokenizers" / name
    chat, plain, mb = chat_inputs(texts, tmp)
    marked = tmp / "llama3_marked.jinja"
    marked.write_text(LLAMA3_MARKED, encoding="utf-8")
    runs = {
        "plain": (plain, ()),
        "chat, tokenizer's template (rendered-prefix)": (chat, ("--chat",)),
        "chat, marked template (generation)": (chat, ("--chat", "--chat-template", str(marked))),
    }
    flags = ("--workers", str(args.workers), "--overwrite", "--quiet")
    times: dict[str, list[float]] = {label: [] for label in runs}
    cpu: dict[str, list[float]] = {label: [] for label in runs}
    run_pipe(plain, tokenizer_dir, tmp / "warm", args.workers, env, flags=flags)  # proves once
    for _ in range(args.repeat):
        for label, (src, extra) in runs.items():
            before = os.times()
            elapsed, _, manifest = run_pipe(
                src, tokenizer_dir, tmp / "chat_out", args.workers, env, flags=(*extra, *flags)
            )
            after = os.times()
            times[label].append(elapsed)
            cpu[label].append(
                after.children_user
                + after.children_system
                - before.children_user
                - before.children_system
            )
        if manifest["counts"].get("bad_lines"):
            sys.exit(f"chat run skipped lines: {manifest['bad_line_examples']}")
    print(
        f"chat: {len(texts):,} conversations of {mb:,.1f} MB of text (2-8 turns each), "
        f"{name}, {args.workers} workers, median of {args.repeat}"
    )
    base = statistics.median(times["plain"])
    base_cpu = statistics.median(cpu["plain"])
    ok = True
    for label, values in times.items():
        seconds, cpu_s = statistics.median(values), statistics.median(cpu[label])
        ratio = base / seconds
        met = "met" if ratio >= TARGET_CHAT_VS_PLAIN else "NOT met"
        note = "" if label == "plain" else f"  {ratio:.2f}x plain's MB/s ({met})"
        print(
            f"{name}: {label:46s} {seconds:6.2f} s {mb / seconds:7.1f} MB/s, CPU {cpu_s:5.2f} s "
            f"({base_cpu / cpu_s:.2f}x plain's MB per CPU second){note}"
        )
        ok = ok and ratio >= TARGET_CHAT_VS_PLAIN
    runs_note = "; ".join(f"{label.split(', ')[-1]} {_fmt(v)}" for label, v in times.items())
    print(f"{name}: runs (s): {runs_note}")
    print(f"target: chat >= {TARGET_CHAT_VS_PLAIN}x plain's MB/s (wall) with both templates")
    return ok


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (median)")
    parser.add_argument("--memory-gb", type=float, default=0, help="also check peak memory")
    parser.add_argument("--tokenizers", nargs="+", default=["llama3", "llama2"])
    parser.add_argument(
        "--quiet-wait", type=float, default=0, help="seconds to wait for a quiet machine per run"
    )
    parser.add_argument(
        "--chat", action="store_true", help="measure --chat against plain on the same text"
    )
    args = parser.parse_args()
    QUIET.wait_s = args.quiet_wait
    if not CORPUS.exists():
        sys.exit(f"{CORPUS} not found: set PIPE_BENCH_DATA (corpus/, tokenizers/)")
    import zstandard

    with tempfile.TemporaryDirectory(prefix="pipe-bench-") as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ, XDG_CACHE_HOME=str(tmp / "cache"), PYTHONPATH=str(ROOT))
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiled modules are cached, as for a user
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        plain = tmp / "linux_docs.jsonl"
        with open(CORPUS, "rb") as src, open(plain, "wb") as dst:
            zstandard.ZstdDecompressor().copy_stream(src, dst)
        texts = [json.loads(line)["text"] for line in plain.read_bytes().splitlines()]
        mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        print(
            f"input: {CORPUS.name}: {len(texts):,} documents, {mb:,.1f} MB of unique text "
            f"({plain.stat().st_size / 1e6:,.1f} MB as JSONL); {os.cpu_count()} cores, "
            f"{args.workers} workers, median of {args.repeat} runs; load average "
            f"{os.getloadavg()[0]:.1f} at start"
        )
        results = []
        if args.chat:
            results.append(bench_chat("llama3", texts, args, tmp, env))
            print("all targets met" if all(results) else "some targets NOT met")
            return
        for name in args.tokenizers:
            startup(name, tmp, args.workers, env)
            results.append(bench(name, plain, texts, mb, args, tmp, env))
        if args.memory_gb:
            results.append(memory(plain, args.memory_gb, args.workers, tmp, env))
        print(f"load average {os.getloadavg()[0]:.1f} at the end; {QUIET.note()}")
    print("all targets met" if all(results) else "some targets NOT met")


if __name__ == "__main__":
    main()
