"""`pipe train --lora --load HF_DIR`: adapters trained on a frozen base read straight from a
Hugging Face directory (no convert step). peft loading the exported adapters onto that
directory's transformers model gives pipe's logits; the same command resumes the adapter
checkpoints (the base read again from the recorded directory) as one uninterrupted run, and
refuses in one line once the directory's weights have changed.

The model is `tests.builders.save_hf("llama")`: a perturbed tiny Llama 3 saved by transformers
in several safetensors shards with an index; the data is mock tokens."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import read_checkpoint_record
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.loop.trainer import Trainer
from pipeline.weights.formats import open_source
from pipeline.weights.model import model_from_source
from tests.builders import VOCAB, records, run_pipe, save_hf
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATTENTION_AND_MLP = '["q", "k", "v", "o", "gate", "up", "down"]'
PROBE = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _sets(run_dir: Path, *extra: str, iters: int) -> list[str]:
    """A few fp32 CPU LoRA steps on mock tokens; the lr schedule spans 4 iterations whatever
    `iters` is, so a run stopped early and continued follows the uninterrupted one."""
    return [
        "data.mock=true",
        "data.seq_length=16",
        "data.num_workers=0",
        f"training.iters={iters}",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.eval_interval=0",
        "training.log_interval=1",
        "training.dtype=fp32",
        "training.device=cpu",
        "optimizer.lr=0.02",
        "scheduler.warmup_iters=0",
        "scheduler.decay_iters=4",
        "checkpoint.save_interval=2",
        "lora.rank=4",
        "lora.alpha=8",
        f"lora.targets={ATTENTION_AND_MLP}",
        f"logging.run_dir={run_dir}",
        *extra,
    ]


def _trainer(hf_dir: Path, run_dir: Path, *extra: str, iters: int) -> Trainer:
    flags = {"load": str(hf_dir), "lora": True}
    return Trainer(resolve_config(None, _sets(run_dir, *extra, iters=iters), flags), console=False)


def test_peft_loads_the_adapters_onto_the_hf_directory(tmp_path: Path) -> None:
    """Three LoRA steps on the Hugging Face base, `pipe export --peft`: peft on the same
    directory's transformers model gives the trained model's logits (adapters unmerged) and the
    merged view of the adapter checkpoint's, within 1e-4 in fp32; only adapters are saved."""
    hf_dir, _ = save_hf("llama", tmp_path / "hf")
    trainer = _trainer(hf_dir, tmp_path / "run", iters=3)
    base_logits = _logits(trainer.model)
    trainer.train()
    adapters = tmp_path / "run" / "checkpoints"
    saved = read_checkpoint_record(adapters / "iter_0000003")["metadata"]
    assert saved["converted_from"] == str(hf_dir)
    assert all(".lora_" in name for name in _saved_weights(adapters / "iter_0000003"))

    run_pipe("export", adapters, "--peft", "-o", tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir.resolve())
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf.eval(), tmp_path / "peft")
    with torch.no_grad():
        theirs = hf(input_ids=PROBE).logits
    ours = _logits(trainer.model)
    merged = _logits(model_from_source(open_source(adapters, "pipe")))
    assert (ours - theirs).abs().max() < 1e-4
    assert (merged - theirs).abs().max() < 1e-4
    assert (ours - base_logits).abs().max() > 1e-3  # the adapters trained


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval().logits(PROBE).float()


def _saved_weights(directory: Path) -> list[str]:
    """The model tensors a checkpoint holds (its DCP metadata's `model.*` keys)."""
    from pipeline.checkpoint.safe_reader import load_dcp_metadata

    keys = load_dcp_metadata(directory / ".metadata").state_dict_metadata
    return [k for k in keys if k.startswith("model.")]


def test_the_same_command_resumes_and_a_changed_base_is_refused(tmp_path: Path, caplog) -> None:
    """`pipe train --lora --load HF_DIR` stopped at iteration 2 and run again to 4 gives the
    uninterrupted run's losses bit for bit (dropout on: RNG states restored); the adapter
    checkpoint records the directory and its checksum as the base, and once a weight file of
    the directory is rewritten the same command is refused in one line (as are another base
    beside the directory, and `save_hf`, which would write the base alone)."""
    hf_dir, _ = save_hf("llama", tmp_path / "hf")
    dropout = "lora.dropout=0.1"
    _trainer(hf_dir, tmp_path / "a", dropout, iters=4).train()
    run_b = tmp_path / "b"
    for iters in (2, 4):
        sets = [f"--set={s}" for s in _sets(run_b, dropout, iters=iters)]
        run_pipe("train", "--lora", "--load", hf_dir, *sets)
    a, b = records(tmp_path / "a"), records(run_b)
    assert [a[s]["loss"] for s in (1, 2, 3, 4)] == [b[s]["loss"] for s in (1, 2, 3, 4)]
    assert a[4]["grad_norm"] == b[4]["grad_norm"]
    base = read_checkpoint_record(run_b / "checkpoints" / "iter_0000004")["metadata"]["lora"]
    assert base["base"]["path"] == str(hf_dir.resolve()) and base["base"]["iteration"] is None
    assert len(base["base"]["checksum"]) == 64
    first = read_checkpoint_record(run_b / "checkpoints" / "iter_0000002")["metadata"]["lora"]
    assert first["base"] == base["base"]

    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        resumed = _trainer(hf_dir, run_b, dropout, iters=6)
    assert resumed.iteration == 4
    assert f"LoRA base: the Hugging Face model {hf_dir.resolve()}" in caplog.text
    assert f"{run_b / 'checkpoints'} holds a checkpoint: resuming it" in caplog.text

    with pytest.raises(ConfigError, match="a Hugging Face directory that is itself the base"):
        _trainer(hf_dir, run_b, "lora.base=other", iters=6)
    with pytest.raises(ConfigError, match="would write the base without the adapters"):
        _trainer(hf_dir, run_b, "checkpoint.save_hf=final", iters=6)

    _rewrite_a_weight(hf_dir)
    with pytest.raises(ConfigError) as caught:
        _trainer(hf_dir, run_b, dropout, iters=6)
    message = str(caught.value)
    assert message.startswith(f"the Hugging Face model {hf_dir.resolve()} has changed since")
    assert "\n" not in message and "recorded " + base["base"]["checksum"][:12] in message


def _rewrite_a_weight(hf_dir: Path) -> None:
    """Save one shard again with one weight nudged: same names, shapes, dtypes and size."""
    from safetensors.torch import load_file, save_file

    shard = sorted(hf_dir.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1e-3
    size = shard.stat().st_size
    save_file(tensors, shard, metadata={"format": "pt"})
    assert shard.stat().st_size == size


def _fsdp_worker(rank: int, world_size: int, tmp: Path, hf_dir: str) -> tuple[dict, str]:
    trainer = _trainer(Path(hf_dir), tmp / "run", "parallel.dp=2", iters=2)
    losses = trainer.train().losses
    return losses, trainer.run_state.adapter.base.checksum


@pytest.mark.dist
def test_fsdp_ranks_share_the_base_and_its_checksum(tmp_path: Path) -> None:
    """dp2 (FSDP): each rank reads its shards of the Hugging Face base, the files are hashed
    once over the two ranks (each its share), and both record the single process's checksum;
    the losses are the single process's to fp32 summation order."""
    hf_dir, _ = save_hf("llama", tmp_path / "hf")
    one = _trainer(hf_dir, tmp_path / "one", iters=2)
    single = one.train().losses
    per_rank = run_distributed(_fsdp_worker, 2, tmp_path / "dp2", str(hf_dir))
    for losses, checksum in per_rank:
        assert checksum == one.run_state.adapter.base.checksum
        for iteration, loss in single.items():
            assert losses[iteration] == pytest.approx(loss, rel=1e-5)
