"""Builders shared by the tests, in one place: paths into the shared test data (`SHARED_DATA`,
tokenizers and corpora that sit beside the checkout in CI), sample texts and JSONL files, the
megatron-core oracle writer, tiny models (ours and Hugging Face's), the micro training run's
settings, and helpers that run pipe (in-process or in a fresh interpreter).

Fixtures stay in conftest.py; everything here is a plain function or constant, imported as
`from tests.builders import ...`."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def shared_file(relative: str) -> Path:
    """A file of the shared test data (`SHARED_DATA`), or skip the test when the folder is absent
    (a user's clone)."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not found (the shared test data sits beside the checkout in CI only)")
    return path


SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "日本語のテキストと中文文本，还有한국어.",
    "emoji 👩‍👩‍👧‍👦 and 🎉🎉 plus café naïve",
    "   leading and trailing spaces   \t\t\n\r\n",
    "numbers 1234567890 3.14159 1e-10",
    "",
    "DON'T stop; we're here, they'll go",
]


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


@contextmanager
def quiet_megatron() -> Iterator[None]:
    """Import megatron-core modules inside this block without its warnings (no TE or Apex on a
    CPU), or skip the test when megatron-core is not installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        except ImportError:
            pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core)")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def megatron_builder():
    """megatron-core's IndexedDatasetBuilder/IndexedDataset, or skip when not installed."""
    with quiet_megatron():
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    return IndexedDatasetBuilder, IndexedDataset


def megatron_preprocess(documents: list, encode, eod: int | None, dtype, prefix: Path) -> str:
    """What Megatron's preprocess_data.py writes (document level) for `documents`, each a string
    or a list of sentences: empty sentences dropped, EOD appended to the last sentence of a
    non-empty document when `eod` is given, one `add_document` per document."""
    builder_cls, _ = megatron_builder()
    builder = builder_cls(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        sentences = [doc] if isinstance(doc, str) else doc
        ids = [encode(s) for s in sentences]
        ids = [x for x in ids if x]
        if ids and eod is not None:
            ids[-1] = ids[-1] + [eod]
        flat = [t for x in ids for t in x]
        builder.add_document(flat, [len(x) for x in ids])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def file_bytes(prefix: str | os.PathLike) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def micro_model_config(**overrides):
    """The micro dense model the parallel tests compare against one device: 2 layers, hidden 32,
    4 heads over 2 kv heads, ffn 64, vocab 128 (fp32-sized for gloo on 2 cores)."""
    from pipeline.core.model.config import ModelConfig

    fields = dict(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
    )
    return ModelConfig(**(fields | overrides))


# ---- tiny models: ours, and Hugging Face's as the numerics oracle -----------------------------

VOCAB, HIDDEN, LAYERS, FFN, SEQ = 96, 64, 2, 96, 16  # the `hf_case` models
EXPORT_VOCAB = 250  # not a multiple of 4: tp4 pads lm_head with 2 zero rows
SHARD_BYTES = 40_000  # tiny models are ~100-500 KB: several shards each


def build_model(config):
    """meta build -> to_empty -> init_weights, the order the trainer uses."""
    import torch

    from pipeline.core.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def perturbed(model):
    """`model` with every weight moved off its init (norms not all ones, biases not all zeros),
    so a mapping mistake shows in the logits."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def perturbed_with_bias(model):
    """`perturbed(model)`, its MoE correction biases (`e_score_correction_bias` buffers of
    DeepSeek-style routers) drawn large enough to change which experts are chosen."""
    import torch

    perturbed(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def hf_case(name: str):
    """(HF model class, HF config, our config) for a tiny model of the named architecture."""
    transformers = pytest.importorskip("transformers")

    from pipeline.core.model.config import ModelConfig, MoEConfig, RopeScaling

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    ours = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_layers=LAYERS,
        num_attention_heads=4,
        num_kv_heads=2,
        max_position_embeddings=128,
        norm_eps=1e-5,
    )
    if name.startswith("llama"):
        tied = name == "llama_tied"
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope["original_max_position_embeddings"] = 8
        hf = transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=tied)
        scaling = RopeScaling(factor=8.0, original_max_position_embeddings=8)
        cfg = ModelConfig(
            **ours, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=tied
        )
        return transformers.LlamaForCausalLM, hf, cfg
    if name == "mistral":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        hf = transformers.MistralConfig(**common, head_dim=24, rope_parameters=rope)
        hf.sliding_window = None
        return transformers.MistralForCausalLM, hf, ModelConfig(**ours, head_dim=24, rope_theta=1e4)
    if name == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        hf = transformers.Qwen2Config(**common, rope_parameters=rope)
        return transformers.Qwen2ForCausalLM, hf, ModelConfig(**ours, qkv_bias=True, rope_theta=1e6)
    assert name == "mixtral"
    rope = {"rope_type": "default", "rope_theta": 1e6}
    hf = transformers.MixtralConfig(
        **common, num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope
    )
    hf.sliding_window = None
    moe = MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.0)
    return transformers.MixtralForCausalLM, hf, ModelConfig(**ours, moe=moe, rope_theta=1e6)


def save_hf(name: str, directory: Path) -> tuple[Path, object]:
    """A perturbed tiny HF model of architecture `name`, saved by transformers in shards."""
    import torch

    hf_cls, hf_config, _ = hf_case(name)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = perturbed(hf_cls(hf_config).eval())
    hf.save_pretrained(directory, max_shard_size=SHARD_BYTES)
    return directory, hf


def disk_tensors(directory: Path) -> dict:
    """Every tensor of the safetensors files in `directory`, by name (copies)."""
    from safetensors import safe_open

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name).clone()
    return out


def cli_hf_round_trip(directory: Path, work: Path) -> tuple[Path, str]:
    """`pipe convert --from hf` then `--to hf` with default flags, each step verifying its
    logits against transformers; returns the directory written back, whose tensors are
    checked bit-identical to `directory`'s, dtype included (the caller compares the configs),
    and what the second command printed."""
    import torch
    from click.testing import CliRunner

    from pipeline.convert.commands import convert

    ckpt, back = work / "ckpt", work / "back"
    result = CliRunner().invoke(convert, [str(directory), "--from", "hf", "-o", str(ckpt), "-q"])
    assert result.exit_code == 0, result.output
    assert "bit-identical" in result.output and "logits match transformers" in result.output
    result = CliRunner().invoke(convert, [str(ckpt), "--to", "hf", "-o", str(back), "-q"])
    assert result.exit_code == 0, result.output
    assert "logits match transformers" in result.output
    original, converted = disk_tensors(directory), disk_tensors(back)
    assert original.keys() == converted.keys()
    for tensor_name, tensor in original.items():
        assert converted[tensor_name].dtype == tensor.dtype, tensor_name
        assert torch.equal(converted[tensor_name], tensor), tensor_name
    return back, result.output


def load_from_source(source):
    """Our model from a `TensorSource`; a tied source lists only the embedding, so tie it here."""
    model = build_model(source.model_config)
    state = {name: source.read(name) for name in source.tensors()}
    if source.model_config.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model


def assert_hf_round_trip(path: Path, hf, out: Path, tokens=None) -> dict:
    """HF directory `path` (saved from transformers' `hf`) -> our reader -> `write_hf(out)`:
    the same tensor names and bytes, the same config values; our model from the reader and
    transformers from the written files both give `hf`'s logits of `tokens` (default: two
    random rows) to 1e-4. Returns the written tensors by name."""
    import torch

    pytest.importorskip("transformers")
    from pipeline.weights.hf_reader import HFSource
    from pipeline.weights.hf_writer import write_hf
    from pipeline.weights.source import InMemorySource

    source = HFSource(path)
    memory = InMemorySource(
        source.model_config, {n: source.read(n) for n in source.tensors()}, source.metadata
    )
    out = write_hf(memory, out, max_shard_bytes=SHARD_BYTES)
    original, written = disk_tensors(path), disk_tensors(out)
    assert sorted(original) == sorted(written)
    for tensor_name, tensor in original.items():
        assert torch.equal(written[tensor_name], tensor), tensor_name
    # Every value the source config sets comes back (a writer may add keys the class ignores).
    source_config, written_config = hf_config_dict(path), hf_config_dict(out)
    changed = {
        key: (value, written_config.get(key))
        for key, value in source_config.items()
        if value is not None and written_config.get(key) != value
    }
    assert not changed
    if tokens is None:
        vocab = source.model_config.vocab_size
        tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator())
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        assert (load_from_source(source).logits(tokens) - expected).abs().max() < 1e-4
        # the class itself: Mistral 4 has no AutoModelForCausalLM entry
        reloaded = type(hf).from_pretrained(out, attn_implementation="eager").eval()
        assert (reloaded(input_ids=tokens).logits - expected).abs().max() < 1e-4
    return written


def hf_config_dict(directory: Path) -> dict:
    """transformers' view of `directory`'s config.json, without the fields that name the
    writer (version, path, dtype)."""
    transformers = pytest.importorskip("transformers")
    d = transformers.AutoConfig.from_pretrained(directory).to_dict()
    for key in ("transformers_version", "_name_or_path", "dtype"):
        d.pop(key, None)
    return d


def export_hf_model(arch: str, seed: int = 0):
    """A tiny HF model for the export tests: 3 layers (pp2 splits 2 + 1), 4 query heads over 2
    kv heads (fewer than tp4), weights perturbed so norms and biases are not their init values."""
    import torch

    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=EXPORT_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    llama3_rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3_rope["original_max_position_embeddings"] = 16
    if arch == "llama3":
        config = transformers.LlamaConfig(**common, rope_parameters=llama3_rope)
        cls = transformers.LlamaForCausalLM
    elif arch == "llama32_tied":
        config = transformers.LlamaConfig(
            **common, rope_parameters=llama3_rope, tie_word_embeddings=True
        )
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":  # an explicit head_dim: 4 heads of 24 over hidden 64
        config = transformers.MistralConfig(
            **common, head_dim=24, rope_parameters={"rope_theta": 1e4}
        )
        config.sliding_window = None
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_parameters={"rope_theta": 1e6})
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        config.sliding_window = None
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    return perturbed(cls(config).eval())


# ---- the micro training run -----------------------------------------------------------------

MICRO_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.vocab_size=128",
]


def micro_sets(run_dir: Path, *extra: str, iters: int = 8, mbs: int = 2) -> list[str]:
    """`--set` assignments for a micro model on mock data, seq 32, gbs 8, CPU, fp32."""
    return [
        *MICRO_MODEL,
        "data.mock=true",
        "data.seq_length=32",
        "data.num_workers=0",
        f"training.iters={iters}",
        f"training.micro_batch_size={mbs}",
        "training.global_batch_size=8",
        "training.eval_interval=4",
        "training.eval_iters=2",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "scheduler.warmup_iters=1",
        "checkpoint.save_interval=4",
        f"logging.run_dir={run_dir}",
        *extra,
    ]


def records(run_dir: Path, split: str = "train") -> dict[int, dict]:
    """metrics.jsonl records of one split by step (the last one wins after a resume)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    out = {}
    for line in lines:
        record = json.loads(line)
        if record["split"] == split:
            out[record["step"]] = record
    return out


def run_python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


KILL_AFTER_SAVE = """
    import os, signal, sys
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    iteration, recipe, sets = int(sys.argv[1]), sys.argv[2] or None, sys.argv[3:]
    original = Trainer.save_checkpoint

    def save_then_die(self):
        path = original(self)
        if self.iteration == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    Trainer.save_checkpoint = save_then_die
    Trainer(resolve_config(recipe, sets), console=False).train()
"""


def run_training_process(code: str, *args: str):
    """`run_python(code, *args)` for a run that is killed or signalled, forked from the test fork
    server (tests/forked.py) so that it skips seconds of imports; a Popen-like handle."""
    from tests.forked import run_forked

    return run_forked(code, *args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def kill_after_save(iteration: int, recipe: str | None, sets: list[str]):
    """A training run of `recipe` (None: the defaults) with `sets` in a process of its own that
    SIGKILLs itself right after saving `iteration`."""
    return run_training_process(KILL_AFTER_SAVE, str(iteration), recipe or "", *sets)


def lm_runner(model):
    """The whole `model` trained on language modelling, as the trainer runs a `tiny` model."""
    from pipeline.train.loop.step_runner import LocalStepRunner
    from pipeline.train.objectives.language_model.objective import LanguageModelling

    return LocalStepRunner(model, LanguageModelling())


def nan_loss(monkeypatch: pytest.MonkeyPatch, bad_calls: set[int] | None) -> None:
    """Make the loss NaN on the given micro-batch calls (all of them when None)."""
    import pipeline.train.objectives.language_model.objective as lm

    original = lm.token_loss
    calls = {"n": 0}

    def poisoned(model, hidden, batch):
        calls["n"] += 1
        loss_sum, tokens = original(model, hidden, batch)
        if bad_calls is None or calls["n"] in bad_calls:
            loss_sum = loss_sum * float("nan")
        return loss_sum, tokens

    monkeypatch.setattr(lm, "token_loss", poisoned)


# ---- running pipe ---------------------------------------------------------------------------


def run_pipe(*args, expect_ok: bool = True, env: dict | None = None):
    """`pipe ARGS` in-process (click's runner); asserts success unless not `expect_ok`."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, env=env)
    if expect_ok:
        assert result.exit_code == 0, result.output
    return result


def free_port() -> int:
    """A TCP port free on this host right now (for torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The layout tests' micro run: every parallel layout of it is compared with one device
# (tests/train/test_layouts.py; tests/train/test_gpu_defaults_on_cpu.py under compile and bf16).
LAYOUT_ITERS = 3
LAYOUT_RESUMED_ITERS = 5
LAYOUT_MICRO = [
    "model.num_layers=4",  # pp2 with two virtual stages per rank needs 4 layers
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.vocab_size=128",
    "model.max_position_embeddings=32",
]
LAYOUT_MOE = ["model.num_experts=4", "model.moe_top_k=2"]
LAYOUT_MOE_RECIPES = ("tiny_moe", "tiny_qwen3_moe", "tiny_deepseek_v3")
# Qwen3's explicit head_dim, kept different from hidden_size / heads (8).
LAYOUT_QWEN3 = ["model.head_dim=16"]


def layout_sets(recipe: str, run_dir: Path, *extra: str, save: bool = True) -> list[str]:
    """The micro run of `recipe`: mock data, seq 32, gbs 8 in micro-batches of 2, fp32, CPU;
    with `save` False, no checkpoint (a save is a second or more of a micro run on 2 cores).

    The mock data's sample indices (2 million samples a split: most of a micro run's time) are
    cached beside `run_dir`, so the runs of one test (every layout, every rank) build them once
    and memory-map them after, as ranks do with real data."""
    return [
        *LAYOUT_MICRO,
        # DeepSeek-V3 keeps its flavor's 8 experts in 4 groups (top-2 from the best 2 groups).
        *(LAYOUT_MOE if recipe in ("tiny_moe", "tiny_qwen3_moe") else []),
        *(LAYOUT_QWEN3 if recipe.startswith("tiny_qwen3") else []),
        "data.mock=true",
        "data.seq_length=32",
        "data.num_workers=0",
        f"data.data_cache_path={run_dir.parent / 'mock_indices'}",
        f"training.iters={LAYOUT_ITERS}",
        "training.micro_batch_size=2",
        "training.global_batch_size=8",
        f"training.eval_interval={LAYOUT_ITERS}",
        "training.eval_iters=1",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "scheduler.warmup_iters=1",
        f"scheduler.decay_iters={LAYOUT_RESUMED_ITERS}",  # the same schedule for runs of any length
        f"checkpoint.save_interval={LAYOUT_ITERS}",
        f"logging.run_dir={run_dir}",
        *([] if save else ["checkpoint.enable=false"]),
        *extra,
    ]


def _full_gradients(trainer) -> dict:
    """Every parameter's gradient on this rank as a full tensor (DTensors gathered: every rank
    of a stage must call this, in the same order)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, param in trainer.model.named_parameters():
        grad = param.grad
        assert grad is not None, f"{name} has no gradient"
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    return grads


def train_and_probe(recipe: str, sets: list[str]) -> dict:
    """Train as `sets` say, then take the gradients of the first global batch again."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    trainer = Trainer(resolve_config(recipe, sets), console=False)
    result = trainer.train()
    probe_loss = _probe_gradients(trainer)
    grads = _full_gradients(trainer)
    records = _metric_lines(Path(trainer.run_dir))
    valid = [r for r in records if r["split"] == "valid"]
    train = [r for r in records if r["split"] == "train"]
    return {
        "losses": result.losses,
        "valid": valid[-1]["loss"] if valid else None,
        "moe_max_load": train[-1].get("moe_max_load") if train else None,
        "probe": probe_loss,
        "grads": grads,
        "first_of_stage": trainer.layout.rank == trainer.layout.first_rank_of_stage,
    }


def _probe_gradients(trainer) -> float:
    """Forward and backward of the first global batch again, without an optimizer step: the
    gradients stay in the parameters. Returns the global loss."""
    from pipeline.train.loop.train_step import forward_backward, reduce_loss_sum

    micro_batches = trainer.next_global_batch(iter(trainer.train_loader))
    layout = trainer.layout
    trainer.optimizer.zero_grad(set_to_none=True)
    loss_sum, tokens = forward_backward(
        trainer.model,
        micro_batches,
        autocast=trainer.autocast,
        dp_group=layout.batch_group,
        runner=trainer.step_runner,
    )
    reduce_loss_sum(loss_sum, layout.batch_group, layout.pipeline_group)
    return float(loss_sum) / max(float(tokens), 1.0)


def _metric_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- FP8 export: a tokenized corpus and briefly trained models ------------------------------

FP8_VOCAB = 512
# The families `pipe export` is tested on, each a tiny model of the same width with the family's
# own features (tests/export: trained once per session by the `trained_family` fixture).
EXPORT_FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


def export_family(name: str, **overrides) -> tuple[str, object]:
    """(Hugging Face architecture, our `ModelConfig`) of the export tests' tiny `name` model:
    2 layers, hidden 64, 4 query heads over 2 kv heads, ffn 128, vocab `FP8_VOCAB`."""
    from pipeline.core.model.config import ModelConfig, MoEConfig, RopeScaling

    common = dict(
        vocab_size=FP8_VOCAB,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        max_position_embeddings=256,
    )
    families = {
        "llama3": (
            "LlamaForCausalLM",
            dict(
                rope_theta=5e5,
                rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16),
            ),
        ),
        "mistral": ("MistralForCausalLM", dict(head_dim=24, rope_theta=1e4)),
        "qwen2": ("Qwen2ForCausalLM", dict(qkv_bias=True, rope_theta=1e6)),
        "qwen3": ("Qwen3ForCausalLM", dict(qk_norm=True, head_dim=32, rope_theta=1e6)),
        "mixtral": ("MixtralForCausalLM", dict(moe=MoEConfig(num_experts=4, top_k=2))),
        "qwen3_moe": (
            "Qwen3MoeForCausalLM",
            dict(
                qk_norm=True,
                head_dim=32,
                moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=64, dense_layers=[0]),
            ),
        ),
    }
    architecture, extra = families[name]
    return architecture, ModelConfig(**(common | extra | overrides))


def tokenized_corpus(texts: list[str], directory: Path) -> Path:
    """`texts` tokenized with a 512-token BPE trained on them, as a .bin/.idx prefix."""
    import numpy as np
    from tokenizers import Tokenizer

    from pipeline.data.indexed import IndexedDatasetWriter
    from pipeline.examples.stdlib_corpus import train_tokenizer

    tokenizer = Tokenizer.from_file(
        str(train_tokenizer(texts, directory / "tok", FP8_VOCAB) / "tokenizer.json")
    )
    prefix = directory / "corpus_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for encoding in tokenizer.encode_batch(texts):
            writer.add_document(np.array(encoding.ids, dtype=np.uint16), [len(encoding.ids)])
        writer.finalize()
    return prefix


def train_briefly(config, tokens, steps: int = 150):
    """Our model trained `steps` AdamW steps on 64-token windows of `tokens`: an untrained
    model's near-flat logits let any rounding flip the top-1 token."""
    import torch
    import torch.nn.functional as F

    from pipeline.core.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - 65, (16,), generator=generator)
        batch = torch.stack([tokens[s : s + 65] for s in starts.tolist()])
        logits = model.logits(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        aux = model.moe_aux_loss()
        (loss if aux is None else loss + aux).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


THINK_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
THINK_SPECIAL = ["<|im_start|>", "<|im_end|>", "[THINK]", "[/THINK]", "[TOOL_CALLS]"]


def with_think_tokens(tokenizer_dir: Path, directory: Path) -> Path:
    """A copy of the Hugging Face tokenizer in `tokenizer_dir` with Qwen3's reasoning and tool
    markers as plain added tokens (as Qwen3 has them) and ChatML's and Mistral's special tokens,
    in `directory` (the reasoning parsers' tests)."""
    import json

    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    added = tokenizers.AddedToken
    tok.add_tokens([added(m, special=False, normalized=False) for m in THINK_MARKERS])
    tok.add_special_tokens([added(m, special=True, normalized=False) for m in THINK_SPECIAL])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def llama_answering(prompt: list[int], reply: list[int], vocab_size: int, eos_id: int):
    """A tiny Hugging Face Llama trained on one conversation (`prompt` then `reply`, token ids)
    until greedy decoding writes `reply` back: a served model whose output is known (the
    reasoning parsers' server tests)."""
    import torch
    import transformers

    ids = torch.tensor([prompt + reply])
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    return model


def served_text(
    tokenizer_dir: Path, prompt: list[int], output: list[int], skip_special_tokens: bool = True
) -> str:
    """The text vLLM serves for `output` after `prompt`: the `tokenizers` library's
    `DecodeStream` (what vLLM's detokenizer steps), primed with the prompt, over the output's
    ids; a character the output leaves incomplete at its end is never written."""
    from tokenizers.decoders import DecodeStream

    tokenizer = _rust_tokenizer(str(Path(tokenizer_dir) / "tokenizer.json"))
    stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special_tokens)
    pieces = (stream.step(tokenizer, token) for token in output)
    return "".join(piece for piece in pieces if piece is not None)


@functools.lru_cache(maxsize=8)
def _rust_tokenizer(path: str):
    """The `tokenizers` library's tokenizer of `path`, read once (Llama 3's takes ~0.2 s)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)
