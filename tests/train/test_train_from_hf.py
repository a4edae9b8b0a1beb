"""`pipe train --load HF_DIR` and `checkpoint.save_hf`: a model transformers made trains straight
from its Hugging Face directory (no convert step) and comes back as a directory transformers
loads, with the logits of the model pipe trained.

The model is a tiny Llama (width 48, 2 layers, untied output) saved by `save_pretrained` in fp32
with the tests' small tokenizer beside it; the data is a corpus `pipe preprocess` made with that
tokenizer. transformers is the oracle for every logit compared here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CheckpointError
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.loop.trainer import Trainer
from pipeline.train.state.hf_weights import tokenizer_mismatch
from pipeline.weights import model_from_source
from pipeline.weights.pipe_checkpoint import PipeCheckpointSource
from tests.builders import disk_tensors, perturbed, run_pipe, save_hf, write_jsonl
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HF_SIZES = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROBE = torch.tensor([[5, 17, 99, 250, 3, 42, 7, 311, 64, 8, 120, 500]])


def _hf_model(directory: Path, tokenizer_dir: Path, **sizes) -> Path:
    """A perturbed tiny Llama saved by transformers, the tokenizer copied beside it."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = transformers.LlamaConfig(vocab_size=len(vocab) + 8, **(HF_SIZES | sizes))
    torch.manual_seed(0)
    perturbed(transformers.LlamaForCausalLM(config).eval()).save_pretrained(directory)
    shutil.copy(tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    # An instruct model's end-of-turn id beside the end-of-text one (config.json's 2).
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": [2, 7]}')
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tokenizer_dir: Path) -> Path:
    return _hf_model(tmp_path_factory.mktemp("hf") / "tiny_llama", tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_tokenizer_dir: Path) -> str:
    """A `.bin/.idx` prefix `pipe preprocess` made with the model's tokenizer."""
    directory = tmp_path_factory.mktemp("corpus")
    docs = [{"text": f"line {i}: value={i * 7} {'abc' * (i % 5)} the end."} for i in range(400)]
    src = write_jsonl(directory / "docs.jsonl", docs)
    run_pipe(
        "preprocess",
        "-i",
        src,
        "--tokenizer",
        tiny_tokenizer_dir,
        "-o",
        directory / "corpus",
        "--append-eod",
        "--workers",
        "1",
        "--quiet",
    )
    return str(directory / "corpus_text_document")


def _sets(run_dir: Path, *extra: str, iters: int = 3) -> list[str]:
    """A few fp32 CPU steps on the corpus, seq 32, gbs 4 in micro-batches of 2."""
    return [
        "data.seq_length=32",
        "data.num_workers=0",
        f"training.iters={iters}",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.eval_interval=0",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "scheduler.warmup_iters=1",
        "optimizer.lr=1e-3",
        f"checkpoint.save_interval={iters}",
        f"logging.run_dir={run_dir}",
        *extra,
    ]


def _hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(PROBE).logits[0]


def _pipe_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval().logits(PROBE)[0].float()


def test_the_model_is_the_hf_directory_and_comes_back_bit_for_bit(hf_dir, corpus, tmp_path, caplog):
    """No recipe names a model: the run builds config.json's; at iteration 0 (no step taken)
    the pipe model has transformers' logits and save_hf writes the same tensors back."""
    cfg = resolve_config(None, _sets(tmp_path / "run"), {"load": str(hf_dir), "data": corpus})
    assert cfg.model.flavor == "checkpoint" and cfg.recorded_model.hf
    assert cfg.model_config().hidden_size == 48 and not cfg.model_config().tie_word_embeddings
    assert cfg.data.tokenizer == str(hf_dir)  # the model's tokenizer, unless one is set
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        trainer = Trainer(cfg, console=False)
    assert f"starting from the Hugging Face model {hf_dir} (iteration 0)" in caplog.text
    assert "tokenized with another" not in caplog.text  # the corpus used the model's tokenizer
    assert trainer.iteration == 0
    reference = _hf_logits(hf_dir)
    torch.testing.assert_close(_pipe_logits(trainer.model), reference, rtol=1e-5, atol=1e-5)
    written = trainer.save_hf()
    assert written == tmp_path / "run" / "checkpoints" / "hf" / "iter_0000000"
    from safetensors.torch import load_file

    ours, theirs = load_file(written / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert (written / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    config = json.loads((written / "config.json").read_text())
    assert (config["torch_dtype"], config["eos_token_id"], config["bos_token_id"]) == (
        "float32",
        2,
        1,
    )
    generation = json.loads((written / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 7]


@pytest.mark.parametrize("architecture", ["qwen2", "mixtral", "llama_tied"])
def test_each_architecture_starts_from_hf_and_saves_it_back(architecture, tmp_path):
    """Sharded Qwen2 (qkv bias), Mixtral (expert stacks) and tied Llama directories: at
    iteration 0 the saved Hugging Face directory has the same architecture and transformers'
    logits, and the same tensors wherever it names them as transformers did."""
    hf_dir, hf_model = save_hf(architecture, tmp_path / "hf")
    sets = [s for s in _sets(tmp_path / "run") if not s.startswith("data.")] + [
        "data.mock=true",
        "data.seq_length=16",
        "data.num_workers=0",
    ]
    trainer = Trainer(resolve_config(None, sets, {"load": str(hf_dir)}), console=False)
    written = trainer.save_hf()
    config = json.loads((written / "config.json").read_text())
    assert config["architectures"] == [type(hf_model).__name__]
    probe = PROBE % hf_model.config.vocab_size
    with torch.no_grad():
        expected = hf_model(probe).logits[0]
        theirs = transformers.AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32)
        torch.testing.assert_close(theirs.eval()(probe).logits[0], expected, rtol=1e-5, atol=1e-5)
    ours, original = disk_tensors(written), disk_tensors(hf_dir)
    shared = ours.keys() & original.keys()
    assert len(shared) >= len(original) // 2
    assert all(torch.equal(ours[k], original[k]) for k in shared)


def test_fine_tune_from_hf_and_save_hf_every(hf_dir, corpus, tmp_path):
    """`pipe train --load HF_DIR` with save_hf = every: one Hugging Face directory per
    checkpoint, each loading in transformers with the logits of the checkpoint pipe saved
    beside it; the checkpoint records the HF tokenizer, so `pipe generate CKPT` needs none."""
    run_dir = tmp_path / "run"
    sets = _sets(run_dir, "checkpoint.save_hf=every", "checkpoint.save_interval=2", iters=4)
    args = [f"--set={s}" for s in sets]
    run_pipe("train", "--load", hf_dir, "--data", corpus, *args)
    save = run_dir / "checkpoints"
    assert sorted(p.name for p in (save / "hf").iterdir()) == ["iter_0000002", "iter_0000004"]
    for iteration in (2, 4):
        trained = model_from_source(PipeCheckpointSource(save / f"iter_{iteration:07d}"))
        hf = _hf_logits(save / "hf" / f"iter_{iteration:07d}")
        torch.testing.assert_close(hf, _pipe_logits(trained), rtol=1e-5, atol=1e-5)
    assert (_hf_logits(save / "hf" / "iter_0000004") - _hf_logits(hf_dir)).abs().max() > 1e-3
    meta = PipeCheckpointSource(save).metadata
    assert meta["iteration"] == 4 and meta["hf_architecture"] == "LlamaForCausalLM"
    assert meta["tokenizer"]["source"] == f"tokenizer:{hf_dir.resolve()}"
    # `pipe generate --chat` on the checkpoint finds the model's tokenizer and chat template
    # and answers as transformers does from the Hugging Face directory saved beside it.
    result = run_pipe(
        "generate", save, "--chat", "--prompt", "line 3:", "--max-new-tokens", "6", "--greedy"
    )
    assert result.output == _transformers_chat(save / "hf" / "iter_0000004", "line 3:", 6) + "\n"


def _transformers_chat(directory: Path, text: str, new: int) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.eval().generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    reply = out[0, ids.shape[1] :].tolist()
    stops = {2, 7}  # generation_config.json's end ids: pipe prints the text before them
    reply = reply[: next((i for i, t in enumerate(reply) if t in stops), len(reply))]
    assert reply, "an empty reply would compare nothing"
    return tokenizer.decode(reply)


def test_rotation_takes_old_hf_directories_along_and_the_dtype_is_asked(hf_dir, corpus, tmp_path):
    """keep_last = 1: the Hugging Face directory of a rotated checkpoint goes with it;
    save_hf_dtype = bfloat16 writes bf16 weights from the fp32 training model."""
    extra = ["checkpoint.save_hf=every", "checkpoint.save_interval=2", "checkpoint.keep_last=1"]
    sets = _sets(tmp_path / "run", *extra, "checkpoint.save_hf_dtype=bfloat16", iters=4)
    flags = {"load": str(hf_dir), "data": corpus}
    Trainer(resolve_config(None, sets, flags), console=False).train()
    save = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in save.iterdir()) == ["hf", "iter_0000004", "latest"]
    assert [p.name for p in (save / "hf").iterdir()] == ["iter_0000004"]
    tensors = disk_tensors(save / "hf" / "iter_0000004")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_a_failed_hf_save_is_one_line_and_leaves_nothing(hf_dir, corpus, tmp_path, monkeypatch):
    import pipeline.weights.hf_writer as hf_writer

    def full_disk(path, obj):
        raise OSError(28, "No space left on device", str(path))

    flags = {"load": str(hf_dir), "data": corpus}
    trainer = Trainer(resolve_config(None, _sets(tmp_path / "run"), flags), console=False)
    monkeypatch.setattr(hf_writer, "write_json", full_disk)
    with pytest.raises(CheckpointError) as caught:
        trainer.save_hf()
    hf_root = tmp_path / "run" / "checkpoints" / "hf"
    message = str(caught.value)
    assert message.startswith(f"saving the Hugging Face model {hf_root / 'iter_0000000'}: ")
    assert "[Errno 28] No space left on device: " in message and "\n" not in message
    assert list(hf_root.iterdir()) == []  # the staged directory is gone, nothing is final


def test_requeued_run_resumes_its_own_checkpoint(hf_dir, corpus, tmp_path):
    """The same `--load HF_DIR` command after a checkpoint was saved resumes that checkpoint."""
    run_dir = tmp_path / "run"
    flags = {"load": str(hf_dir), "data": corpus}
    Trainer(resolve_config(None, _sets(run_dir, iters=2), flags), console=False).train()
    resumed = Trainer(resolve_config(None, _sets(run_dir, iters=4), flags), console=False)
    assert resumed.iteration == 2


def test_bad_hf_directories_are_refused_in_one_line(hf_dir, corpus, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (broken / "config.json").write_text("{not json")
    no_config = tmp_path / "no_config"
    shutil.copytree(hf_dir, no_config)
    (no_config / "config.json").unlink()
    no_weights = tmp_path / "no_weights"
    shutil.copytree(hf_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    cases = {
        broken: f"{broken}: not a usable Hugging Face model directory: {broken / 'config.json'}: "
        "not a readable JSON file",
        no_config: "holds model.safetensors but no config.json",
        no_weights: "no *.safetensors (or pytorch_model.bin) weights",
    }
    for directory, message in cases.items():
        with pytest.raises(ConfigError, match="^checkpoint.load .*") as caught:
            resolve_config(None, _sets(tmp_path / "r"), {"load": str(directory), "data": corpus})
        assert message in str(caught.value) and "\n" not in str(caught.value)
    result = run_pipe(
        "train",
        "--load",
        no_weights,
        "--data",
        corpus,
        *[f"--set={s}" for s in _sets(tmp_path / "r")],
        expect_ok=False,
    )
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 3


def test_a_recipe_model_of_other_shapes_is_refused_in_one_line(hf_dir, corpus, tmp_path):
    cfg = resolve_config(
        "tiny", _sets(tmp_path / "r"), {"load": str(hf_dir), "data": corpus}, validate=False
    )
    with pytest.raises(ConfigError) as caught:
        Trainer(cfg, console=False)
    message = str(caught.value)
    assert message.startswith(f"Hugging Face model {hf_dir} has model.vocab_size=")
    assert message.endswith("(--set model.flavor=checkpoint trains the model)")


def _layout_worker(rank: int, world_size: int, tmp: Path, hf_dir: str, corpus: str, extra):
    cfg = resolve_config(None, _sets(tmp / "run", *extra), {"load": hf_dir, "data": corpus})
    trainer = Trainer(cfg, console=False)
    result = trainer.train()
    return result.losses


@pytest.mark.dist
def test_fsdp_and_pipeline_load_and_save_hf_as_one_process(hf_dir, corpus, tmp_path):
    """dp2 (FSDP) and pp2 runs started from HF_DIR save the Hugging Face directory one process
    saves, to fp32 summation order (1e-5), and their losses match."""
    flags = {"load": str(hf_dir), "data": corpus}
    cfg = resolve_config(None, _sets(tmp_path / "one", "checkpoint.save_hf=final"), flags)
    one = Trainer(cfg, console=False)
    single = one.train().losses
    reference = load_hf(tmp_path / "one")
    for name, extra in {
        "dp2": ["parallel.dp=2"],
        "pp2": ["parallel.pp=2", "parallel.dp=1"],
    }.items():
        sets = ["checkpoint.save_hf=final", *extra]
        losses = run_distributed(_layout_worker, 2, tmp_path / name, str(hf_dir), corpus, sets)
        for iteration, loss in single.items():
            assert losses[0][iteration] == pytest.approx(loss, rel=1e-5), name
        written = load_hf(tmp_path / name / "run")
        assert written.keys() == reference.keys()
        for key, tensor in reference.items():
            torch.testing.assert_close(written[key], tensor, rtol=1e-5, atol=1e-5, msg=key)


def load_hf(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / "hf" / "iter_0000003" / "model.safetensors")


def test_a_data_tokenizer_other_than_the_models_is_named() -> None:
    def record(**hashes: str) -> dict:
        files = [
            {"path": f"/x/{name.replace('_', '.')}", "sha256": h} for name, h in hashes.items()
        ]
        return {"fingerprint": {"files": files}}

    model = record(tokenizer_json="aa", tokenizer_config_json="bb")
    assert tokenizer_mismatch(record(tokenizer_json="aa"), model) is None
    assert (
        tokenizer_mismatch(record(tokenizer_json="aa", tokenizer_config_json="b2"), model) is None
    )
    assert tokenizer_mismatch(record(tokenizer_json="cc"), model) == (
        "the data was tokenized with another tokenizer.json than the model's"
    )
    assert tokenizer_mismatch(None, model) is None and tokenizer_mismatch(model, None) is None
