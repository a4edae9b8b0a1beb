"""DeepSeek-V3 from the command line, as a user runs it: a tiny `DeepseekV3ForCausalLM` made by
transformers converts in (`pipe convert --from hf`), fine-tunes 20 steps on real text (the first
pages of the Python documentation, `pipe preprocess`ed with the shared Llama 2 tokenizer) under
`pipe train --nproc-per-node 4 --ep 2 --tp 2 --load ... --finetune`, with falling loss, and
converts back out (`pipe convert --to hf`) to a directory transformers loads.

The model is as small as the layout allows: 2 layers (the first dense, as DeepSeek's
`first_k_dense_replace`), latent attention with the q low-rank projection, 8 routed experts in
4 groups (4 per ep rank) plus a shared one, and the balancing bias.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.weights.pipe_checkpoint import PipeCheckpointSource
from tests.builders import ROOT, run_pipe, shared_file, write_jsonl

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.dist]

PAGES = 60  # of the Python documentation: ~150k tokens, far more than 20 steps read
SEQ = 64


def _tiny_deepseek_v3(vocab_size: int):
    config = transformers.DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def _corpus(directory: Path, tokenizer: Path) -> str:
    """The first PAGES pages of the shared Python documentation corpus, preprocessed."""
    import zstandard

    source = shared_file("corpus/python_docs.jsonl.zst")
    with open(source, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as raw:
        lines = io.TextIOWrapper(raw, encoding="utf-8")
        pages = [json.loads(next(lines)) for _ in range(PAGES)]
    docs = write_jsonl(directory / "docs.jsonl", [{"text": p["text"]} for p in pages])
    prefix = directory / "corpus"
    run_pipe(
        "preprocess",
        "-i",
        docs,
        "--tokenizer",
        tokenizer,
        "-o",
        prefix,
        "--append-eod",
        "--workers",
        "1",
        "--quiet",
    )
    return f"{prefix}_text_document"


def test_hf_deepseek_v3_fine_tunes_under_ep2_tp2_and_converts_back(tmp_path: Path) -> None:
    tokenizer = shared_file("tokenizers/llama2/tokenizer.json").parent
    corpus = _corpus(tmp_path, tokenizer)
    hf = _tiny_deepseek_v3(vocab_size=32000)
    hf.save_pretrained(tmp_path / "hf_in")
    run_pipe("convert", tmp_path / "hf_in", "--from", "hf", "-o", tmp_path / "imported", "-q")

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "train",
            "--nproc-per-node",
            "4",
            "--ep",
            "2",
            "--tp",
            "2",
            "--load",
            str(tmp_path / "imported"),
            "--finetune",
            "--data",
            corpus,
            "--iters",
            "20",
            "--seq-length",
            str(SEQ),
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
            "--lr",
            "3e-3",
            "--device",
            "cpu",
            "--run-dir",
            str(run_dir),
            "--set",
            "training.log_interval=1",
            "--set",
            "training.eval_interval=0",
            "--set",
            "scheduler.warmup_iters=2",
            "--set",
            "data.split=90,10,0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    # Neither torchrun's thread banner nor DTensor's warnings (two all-reduces for the gradient
    # norm over dp x tp, one per rank) reach the user.
    output = done.stdout + done.stderr
    for noise in ("Setting OMP_NUM_THREADS", "While redistributing"):
        assert noise not in output, output[-3000:]
    if "OMP_NUM_THREADS" not in env:  # pipe's echoed command says what it set
        assert done.stderr.startswith("OMP_NUM_THREADS=1 "), done.stderr[:300]
    losses = _train_losses(run_dir)
    assert sorted(losses) == list(range(1, 21))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (18, 19, 20)) / 3
    assert last < first - 0.5, losses  # from ~ln(32000) = 10.4 on real text

    trained = PipeCheckpointSource(run_dir / "checkpoints")
    assert trained.metadata["iteration"] == 20
    run_pipe("convert", run_dir / "checkpoints", "--to", "hf", "-o", tmp_path / "hf_out", "-q")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    # The fine-tuned weights came out, not the imported ones.
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    before, after = hf.state_dict()[name], reloaded.state_dict()[name]
    assert before.shape == after.shape and not torch.equal(before, after)
    with torch.no_grad():
        logits = reloaded(input_ids=torch.arange(16)[None]).logits
    assert logits.shape == (1, 16, 32000) and torch.isfinite(logits).all()


def _train_losses(run_dir: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}
