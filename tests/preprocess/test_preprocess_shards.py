"""Sharded `pipe preprocess` + `pipe merge --shards`: the merged shards equal, byte for byte, the
unsharded run over the same inputs (itself proven equal to Megatron's in test_preprocess.py); the
partition covers every line once; shards come from flags, torchrun or a Slurm array; missing,
failed and finished shards are handled."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from pipeline.preprocess.readers import InputFile, InputRange, iter_batches, resolve_inputs
from pipeline.preprocess.shards import ShardError, plan_shards, resolve_shard
from tests.builders import ROOT, SAMPLE_TEXTS, file_bytes, free_port, run_pipe

LAUNCH_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
)


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    """Tests start outside any launcher; those that need one set its variables themselves."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


pytestmark = pytest.mark.usefixtures("private_proof_cache")


def preprocess(inputs, tokenizer, out, *extra, expect_ok=True, env=None):
    args = ["preprocess", "-i", *inputs, "--tokenizer", tokenizer, "-o", out, "--append-eod"]
    return run_pipe(*args, "--workers", "1", "-q", *extra, expect_ok=expect_ok, env=env)


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = SAMPLE_TEXTS + [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(50)]
    return [" ".join(rng.choices(pool, k=rng.randint(0, 6))) for _ in range(n)]


def jsonl_bytes(docs: list[str], crlf_every: int = 0, blank_every: int = 0) -> bytes:
    """JSON lines with some CRLF ends and blank lines; the last line has no newline."""
    lines = []
    for i, d in enumerate(docs):
        lines.append(json.dumps({"text": d}, ensure_ascii=False).encode())
        if blank_every and i % blank_every == 0:
            lines.append(b"   " if i % 2 else b"")
    ends = [b"\r\n" if crlf_every and i % crlf_every == 0 else b"\n" for i in range(len(lines))]
    return b"".join(line + end for line, end in zip(lines, ends))[: -len(ends[-1])]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, list[str]]:
    """Three input sets: one large JSONL; many small files; a mix with .zst and .gz files."""
    root = tmp_path_factory.mktemp("shard_inputs")
    (root / "large.jsonl").write_bytes(jsonl_bytes(documents(700, 1), crlf_every=5, blank_every=9))
    many = []
    for i in range(24):
        many.append(root / f"small{i:02d}.jsonl")
        many[-1].write_bytes(jsonl_bytes(documents(5 + i % 7, 100 + i), blank_every=4) + b"\n")
    (root / "mix_a.jsonl").write_bytes(jsonl_bytes(documents(300, 2), crlf_every=3))
    zst = zstandard.ZstdCompressor().compress(jsonl_bytes(documents(200, 3)))
    (root / "mix_b.jsonl.zst").write_bytes(zst)
    (root / "mix_c.jsonl").write_bytes(b"")
    (root / "mix_d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(documents(40, 4))))
    (root / "mix_e.jsonl").write_bytes(jsonl_bytes(documents(250, 5), blank_every=3))
    return {
        "large": [str(root / "large.jsonl")],
        "many": [str(root / "small*.jsonl")],
        "mix": [
            str(root / n)
            for n in (
                "mix_a.jsonl",
                "mix_b.jsonl.zst",
                "mix_c.jsonl",
                "mix_d.jsonl.gz",
                "mix_e.jsonl",
            )
        ],
    }


@pytest.fixture(scope="module")
def unsharded(corpora, tiny_tokenizer_dir, tmp_path_factory) -> dict[str, tuple[bytes, bytes]]:
    """The oracle: each corpus's unsharded run."""
    out = tmp_path_factory.mktemp("unsharded")
    result = {}
    for name, inputs in corpora.items():
        preprocess(inputs, tiny_tokenizer_dir, out / name)
        result[name] = file_bytes(out / f"{name}_text_document")
    return result


# ------------------------------------------------------------------------------ byte identity


@pytest.mark.parametrize("corpus", ["large", "many", "mix"])
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_merged_shards_equal_unsharded_run(
    tmp_path, corpora, unsharded, tiny_tokenizer_dir, corpus, count
):
    inputs = corpora[corpus]
    for index in range(count):
        preprocess(
            inputs,
            tiny_tokenizer_dir,
            tmp_path / "c",
            "--num-shards",
            count,
            "--shard-index",
            index,
        )
    out = run_pipe("merge", "--shards", tmp_path / "c").output
    assert f"merged {count} shards" in out
    assert file_bytes(tmp_path / "c_text_document") == unsharded[corpus]
    manifest = json.loads((tmp_path / "c.json").read_text())
    assert manifest["complete"] and manifest["shards"]["count"] == count
    files = resolve_inputs(inputs)
    assert [i["path"] for i in manifest["inputs"]] == [f.path for f in files]
    if corpus == "large":  # 7 shards cut the one file into 7 non-empty parts
        shard_docs = [
            json.loads((tmp_path / f"c.shard-{i:05d}-of-{count:05d}.json").read_text())["counts"]
            for i in range(count)
        ]
        assert all(c["documents"] > 0 for c in shard_docs)
        assert len(manifest["inputs"][0].get("sha256_parts", [0])) == count


# ------------------------------------------------------------------------------ the partition


def lines_of(parts) -> list[tuple[int, bytes]]:
    """(file line number, line) of every item the reader yields for `parts`, in order."""
    from pipeline.preprocess.readers import file_line

    out = []
    for batch in iter_batches(parts, ["text"], batch_bytes=7, max_batch_items=3):
        out += [(file_line(batch, i), line) for i, line in enumerate(batch.lines or [])]
    return out


@pytest.mark.parametrize("final_newline", [False, True])
def test_every_cut_point_reads_each_line_once(tmp_path, final_newline):
    """Two ranges meeting at any byte read every line exactly once, with its true number:
    lines straddling the cut, CRLF ends, blank lines and a last line without a newline."""
    content = b'{"a": 1}\r\n\n{"b": 22}\nx\r\n\r\n{"c": 333}\n\n\n{"d": 4444}'
    content += b"\n" if final_newline else b""
    path = tmp_path / "f.jsonl"
    path.write_bytes(content)
    f = InputFile(str(path), "jsonl", len(content))
    expected = lines_of([f])
    assert [n for n, _ in expected] == list(range(1, 10))
    for cut in range(len(content) + 1):
        got = lines_of([InputRange(f, 0, cut), InputRange(f, cut, len(content))])
        assert got == expected, cut
    for a in range(0, len(content) + 1, 3):  # three ranges
        for b in range(a, len(content) + 1, 2):
            parts = [InputRange(f, 0, a), InputRange(f, a, b), InputRange(f, b, len(content))]
            assert lines_of(parts) == expected, (a, b)


def test_plan_covers_every_byte_once_in_order():
    rng = random.Random(0)
    kinds = ["jsonl", "jsonl", "jsonl.zst", "jsonl.gz", "parquet"]
    for trial in range(200):
        files = [
            InputFile(
                f"f{i}", rng.choice(kinds), rng.choice([0, 1, 10, 1000, rng.randint(1, 9999)])
            )
            for i in range(rng.randint(1, 12))
        ]
        count = rng.randint(1, 9)
        plan = plan_shards(files, count)
        assert len(plan) == count
        covered = [r for shard in plan for r in shard]  # shard order = input order
        position = {id(f): i for i, f in enumerate(files)}
        assert [position[id(r.file)] for r in covered] == sorted(
            position[id(r.file)] for r in covered
        )
        for f in files:
            mine = [r for r in covered if r.file is f]
            assert mine, (trial, f)
            assert mine[0].start == 0 and mine[-1].end == f.size
            assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
            if f.kind != "jsonl":
                assert len(mine) == 1  # compressed and tabular files are never cut


def test_plan_keeps_many_files_whole_and_splits_large_ones():
    many = [InputFile(f"f{i}", "jsonl", 1000 + 10 * i) for i in range(96)]
    for count in (2, 3, 4, 6):  # >= 16 files a shard: a cut moves by at most 1/32 of a share
        plan = plan_shards(many, count)
        assert all(r.is_whole for shard in plan for r in shard)
        sizes = [sum(r.size for r in shard) for shard in plan]
        assert max(sizes) - min(sizes) <= sum(sizes) / count / 8
    big = [InputFile("big", "jsonl", 7_000_000)]
    assert [[(r.start, r.end) for r in s] for s in plan_shards(big, 7)] == [
        [(k * 1_000_000, (k + 1) * 1_000_000)] for k in range(7)
    ]
    zst = [InputFile("a.zst", "jsonl.zst", 500), InputFile("b.jsonl", "jsonl", 1500)]
    assert [[(r.file.path, r.start, r.end) for r in s] for s in plan_shards(zst, 2)] == [
        [("a.zst", 0, 500), ("b.jsonl", 0, 500)],
        [("b.jsonl", 500, 1500)],
    ]


# ------------------------------------------------------------------------------ environment


def test_shard_from_flags_then_torchrun_then_slurm():
    slurm = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "5"}
    torch = {"RANK": "1", "WORLD_SIZE": "2"}
    assert resolve_shard(None, None, {}) is None
    got = resolve_shard(None, None, slurm)
    assert (got.index, got.count) == (3, 5) and "Slurm" in got.source
    got = resolve_shard(None, None, {**slurm, **torch})
    assert (got.index, got.count) == (1, 2) and "torchrun" in got.source
    got = resolve_shard(4, 0, {**slurm, **torch})
    assert (got.index, got.count) == (0, 4) and "--shard-index" in got.source
    for bad, message in [
        ((3, None, {}), "go together"),
        ((None, 2, {}), "go together"),
        ((2, 2, {}), "index 2 is not in 0..1"),
        ((None, None, {"RANK": "3", "WORLD_SIZE": "3"}), "index 3 is not in 0..2"),
        ((None, None, {"RANK": "x", "WORLD_SIZE": "3"}), "RANK='x' is not an integer"),
        ((None, None, {**slurm, "SLURM_ARRAY_TASK_ID": "9"}), "contiguous array"),
    ]:
        with pytest.raises(ShardError, match=message):
            resolve_shard(*bad)


def test_slurm_array_env_picks_the_shard(tmp_path, corpora, unsharded, tiny_tokenizer_dir):
    for task in (10, 11, 12):
        env = {
            "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_ARRAY_TASK_MIN": "10",
            "SLURM_ARRAY_TASK_COUNT": "3",
        }
        result = run_pipe(
            "preprocess",
            "-i",
            *corpora["mix"],
            "--tokenizer",
            tiny_tokenizer_dir,
            "-o",
            tmp_path / "c",
            "--append-eod",
            "--workers",
            "1",
            env=env,
        )
        assert (
            f"shard {task - 10} of 3 (from Slurm array SLURM_ARRAY_TASK_ID={task}" in result.output
        )
    run_pipe(
        "merge",
        "--shards",
        tmp_path / "c.shard-00000-of-00003_text_document.bin",
        tmp_path / "c.shard-0000[12]-of-00003.json",
    )
    assert file_bytes(tmp_path / "c_text_document") == unsharded["mix"]


def test_torchrun_processes_pick_their_shard(tmp_path, corpora, unsharded, tiny_tokenizer_dir):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "pipeline",
        "preprocess",
        "-i",
        *corpora["large"],
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "-o",
        str(tmp_path / "c"),
        "--append-eod",
        "--workers",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"shard {rank} of 2 (from torchrun RANK={rank} WORLD_SIZE=2)" in proc.stdout
    run_pipe("merge", "--shards", tmp_path / "c")
    assert file_bytes(tmp_path / "c_text_document") == unsharded["large"]


# ------------------------------------------------------------------------------ failures, re-runs


def test_missing_and_failed_shards_are_named(tmp_path, corpora, tiny_tokenizer_dir):
    for index in (0, 2):
        preprocess(
            corpora["many"],
            tiny_tokenizer_dir,
            tmp_path / "c",
            "--num-shards",
            4,
            "--shard-index",
            index,
        )
    result = run_pipe("merge", "--shards", tmp_path / "c", expect_ok=False)
    assert result.exit_code == 1
    assert "shard 1 of 4 is missing" in result.output
    assert "shard 3 of 4 is missing" in result.output
    assert "shard 0 of 4" not in result.output
    assert not (tmp_path / "c_text_document.bin").exists()


def test_error_in_a_mid_file_shard_names_the_true_line(tmp_path, tiny_tokenizer_dir):
    lines = [json.dumps({"text": d}) for d in documents(400, 9)]
    lines[333] = '{"text": "broken'
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    args = ([src], tiny_tokenizer_dir, tmp_path / "c", "--num-shards", 3)
    result = preprocess(*args, "--shard-index", 2, expect_ok=False)
    assert result.exit_code == 1 and "in.jsonl:334: malformed JSON" in result.output
    preprocess(*args, "--shard-index", 0)
    preprocess(*args, "--shard-index", 1)
    merged = run_pipe("merge", "--shards", tmp_path / "c", expect_ok=False)
    assert "shard 2 of 3 failed: " in merged.output and "in.jsonl:334" in merged.output
    # --skip-bad-lines: the failed shard runs again (no --overwrite needed) and reports the line.
    result = preprocess(*args, "--shard-index", 2, "--skip-bad-lines")
    assert "in.jsonl:334: malformed JSON" in result.output


def test_rerunning_a_finished_shard_changes_nothing(tmp_path, corpora, tiny_tokenizer_dir):
    args = (corpora["mix"], tiny_tokenizer_dir, tmp_path / "c", "--num-shards", 2)
    preprocess(*args, "--shard-index", 1)
    files = sorted(tmp_path.iterdir())
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    result = preprocess(*args, "--shard-index", 1)
    assert "shard 1 of 2 already complete" in result.output
    assert sorted(tmp_path.iterdir()) == files
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == before
    # A finished shard made with other flags is refused, unless --overwrite.
    other = [
        "preprocess",
        "-i",
        *args[0],
        "--tokenizer",
        tiny_tokenizer_dir,
        "-o",
        tmp_path / "c",
        "--num-shards",
        2,
        "--shard-index",
        1,
        "-q",
    ]
    result = run_pipe(*other, expect_ok=False)
    assert result.exit_code == 1 and "different flags" in result.output
    run_pipe(*other, "--overwrite")
    assert "done:" in run_pipe(*other[:-1], "--overwrite").output  # overwrite re-runs it


def test_slurm_script_runs_the_array_then_the_merge(
    tmp_path, corpora, unsharded, tiny_tokenizer_dir
):
    """scripts/preprocess_slurm.sh as the tasks of `sbatch --array=0-1`, with a stand-in sbatch
    that records the merge job it is asked to submit; then that job's command."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/sbatch.args\n')
    (fake / "sbatch").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PATH"] = f"{fake}:{Path(sys.executable).parent}:{env['PATH']}"
    script = ROOT / "scripts" / "preprocess_slurm.sh"
    for task in (0, 1):
        env |= {
            "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_ARRAY_TASK_MIN": "0",
            "SLURM_ARRAY_TASK_COUNT": "2",
            "SLURM_ARRAY_JOB_ID": "77",
        }
        proc = subprocess.run(
            [
                "bash",
                str(script),
                *corpora["large"],
                str(tiny_tokenizer_dir),
                str(tmp_path / "c"),
                "--append-eod",
                "-q",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    submitted = (tmp_path / "sbatch.args").read_text().splitlines()
    assert "--dependency=afterok:77" in submitted
    wrap = next(a for a in submitted if a.startswith("--wrap="))[len("--wrap=") :]
    subprocess.run(["bash", "-c", wrap], env=env, cwd=tmp_path, check=True, timeout=120)
    assert file_bytes(tmp_path / "c_text_document") == unsharded["large"]
