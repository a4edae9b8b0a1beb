"""`pipe train --lora` end to end on a CPU: adapters trained on a base checkpoint, exported for
peft (whose logits on the base transformers model match ours, and the merged export's), resumed
bit-exactly after kill -9, and adapter checkpoints a small fraction of a full one."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.checkpoint import read_checkpoint_record
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from pipeline.weights.formats import open_source
from pipeline.weights.model import model_from_source
from pipeline.weights.pipe_checkpoint import write_pipe_checkpoint
from pipeline.weights.source import InMemorySource
from tests.builders import (
    build_model,
    export_family,
    kill_after_save,
    micro_sets,
    perturbed,
    records,
)

ATTENTION_AND_MLP = '["q", "k", "v", "o", "gate", "up", "down"]'
# Expert adapters are written per expert (the on-disk module names), which peft 0.21 fuses for
# transformers 5's experts. Its loading of a Qwen3-MoE's dense-layer (mlp_only_layers) MLP
# adapters does not give transformers' logits, so those are left out for that family.
QWEN3_MOE = '["q", "k", "v", "o", "expert_gate", "expert_up", "expert_down"]'
TARGETS = {
    "llama3": ATTENTION_AND_MLP,
    "qwen3": ATTENTION_AND_MLP,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": '["all"]',
}


def _base(config, directory: Path, architecture: str | None = None) -> tuple[Path, dict]:
    """A perturbed random model of `config` as a weights-only pipe checkpoint."""
    torch.manual_seed(0)
    state = {n: t.detach().clone() for n, t in perturbed(build_model(config)).state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("output.weight")
    metadata = {"hf_architecture": architecture} if architecture else {}
    write_pipe_checkpoint(InMemorySource(config, state, metadata), directory)
    return directory, state


def _lora_sets(run: Path, base: Path, *extra: str, iters: int = 3) -> list[str]:
    return [
        "data.mock=true",
        "data.seq_length=32",
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
        f"checkpoint.load={base}",
        "lora.enabled=true",
        "lora.rank=4",
        "lora.alpha=8",
        f"logging.run_dir={run}",
        *extra,
    ]


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "mixtral"])
def test_peft_loads_the_exported_adapters(family: str, tmp_path: Path) -> None:
    """Three steps of LoRA from a base checkpoint, `pipe export --peft`: peft on the base
    transformers model gives the logits of our base + adapters (unmerged) and of the merged
    checkpoint `pipe export`/`convert` read, within 1e-4 in fp32."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from pipeline.convert.commands import convert
    from pipeline.export.commands import export

    architecture, config = export_family(family)
    base, _ = _base(config, tmp_path / "base", architecture)
    sets = _lora_sets(tmp_path / "run", base, f"lora.targets={TARGETS[family]}")
    trainer = Trainer(resolve_config(None, sets), console=False)
    trainer.train()
    adapters = tmp_path / "run" / "checkpoints"
    assert any(p.abs().max() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)

    runner = CliRunner()
    result = runner.invoke(export, [str(adapters), "--peft", "-o", str(tmp_path / "peft")])
    assert result.exit_code == 0, result.output
    if config.moe is not None:  # every expert's adapters, one expert at a time
        from safetensors import safe_open

        with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
            experts = [k for k in f.keys() if ".experts.3." in k]  # noqa: SIM118
            assert len(experts) == 2 * 3 * (config.num_layers - len(config.moe.dense_layers))
            assert all(f.get_tensor(k).abs().max() > 0 for k in experts)
    result = runner.invoke(convert, [str(base), "--to", "hf", "-o", str(tmp_path / "hf"), "-q"])
    assert result.exit_code == 0, result.output

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf.eval(), tmp_path / "peft")
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    trainer.model.eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = trainer.model.logits(tokens)
        merged = model_from_source(open_source(adapters, "pipe")).logits(tokens)
    assert (ours - theirs).abs().max() < 1e-4
    assert (merged - theirs).abs().max() < 1e-4
    assert (merged - model_from_source(open_source(base, "pipe")).logits(tokens)).abs().max() > 1e-3
    _assert_generation_runs_the_adapters_unmerged(base, adapters, tmp_path / "peft", ours)
    if family == "llama3":  # `pipe convert --to hf` of the adapter checkpoint merges them too
        out = tmp_path / "merged_hf"
        result = runner.invoke(convert, [str(adapters), "--to", "hf", "-o", str(out), "-q"])
        assert result.exit_code == 0, result.output
        merged_hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            assert (merged_hf.eval()(input_ids=tokens).logits - theirs).abs().max() < 1e-4


def _assert_generation_runs_the_adapters_unmerged(base, adapters, peft_dir, expected) -> None:
    """`pipe generate/serve BASE --lora-adapter X` (their loader): the adapters of a pipe
    checkpoint or of the peft files run beside the base weights and give the trained logits."""
    from pipeline.core.model.lora import LoRALinear
    from pipeline.serve.engine.loading import LoadError, open_generator

    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    for adapter in (adapters, peft_dir):
        model = open_generator(base, lora_adapter=adapter).model
        assert isinstance(model.layers["0"].attention.wq, LoRALinear)
        with torch.no_grad():
            assert (model.logits(tokens) - expected).abs().max() < 1e-4
    with pytest.raises(LoadError, match="full checkpoint"):
        open_generator(base, lora_adapter=base)


def test_exact_resume_after_sigkill_and_adapter_checkpoint_size(tmp_path: Path) -> None:
    """A LoRA run (dropout on) SIGKILLed after saving iteration 2 and resumed with --load of
    its adapter checkpoints (the base found from the record, checksum checked) gives the
    uninterrupted run's losses bit for bit; its checkpoint records the base and holds adapters
    and their optimizer state only, under 10% of the bytes of the (weights-only) base."""
    config = resolve_config(None, micro_sets(tmp_path)).model_config()
    base, _ = _base(config, tmp_path / "base")
    extra = ("lora.dropout=0.1", "checkpoint.save_interval=2")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    Trainer(resolve_config(None, _lora_sets(run_a, base, *extra, iters=4)), console=False).train()
    proc = kill_after_save(2, None, _lora_sets(run_b, base, *extra, iters=4))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, output
    resumed = [s for s in _lora_sets(run_b, base, *extra, iters=4) if "checkpoint.load" not in s]
    Trainer(
        resolve_config(None, [*resumed, f"checkpoint.load={run_b / 'checkpoints'}"]), console=False
    ).train()
    a, b = records(run_a), records(run_b)
    assert [a[s]["loss"] for s in (3, 4)] == [b[s]["loss"] for s in (3, 4)]
    assert a[4]["grad_norm"] == b[4]["grad_norm"]

    adapter_dir = run_b / "checkpoints" / "iter_0000004"
    record = read_checkpoint_record(adapter_dir)["metadata"]["lora"]
    assert record["base"]["path"] == str((base / "iter_0000000").resolve())
    assert len(record["base"]["checksum"]) == 64 and record["rank"] == 4


def _checkpoint_bytes(run: Path) -> int:
    return sum(f.stat().st_size for f in (run / "checkpoints" / "iter_0000001").iterdir())


def test_adapter_checkpoint_of_tiny_is_under_a_tenth_of_a_full_one(tmp_path: Path) -> None:
    """`tiny` (the tiny_lora recipe's rank 8 on every projection): one step of full training and
    one of LoRA; the adapter checkpoint (adapters + their Adam state) is < 10% of the full one."""
    sets = [
        "data.seq_length=32",
        "training.iters=1",
        "training.global_batch_size=4",
        "training.micro_batch_size=4",
        "training.eval_interval=0",
        "training.device=cpu",
        "scheduler.warmup_iters=0",
    ]
    full, lora = tmp_path / "full", tmp_path / "lora"
    Trainer(resolve_config("tiny", [*sets, f"logging.run_dir={full}"]), console=False).train()
    Trainer(resolve_config("tiny_lora", [*sets, f"logging.run_dir={lora}"]), console=False).train()
    assert _checkpoint_bytes(lora) < 0.1 * _checkpoint_bytes(full), (
        _checkpoint_bytes(lora),
        _checkpoint_bytes(full),
    )


def test_base_and_adapters_given_apart_and_a_wrong_base_refused(tmp_path: Path) -> None:
    """`--lora-base FULL --load ADAPTERS` resumes (bf16 base storage); a different base than
    the one recorded is refused in one line; --dry-run shows the trainable adapters."""
    from pipeline.train.commands import train
    from pipeline.train.config.schema import ConfigError

    config = resolve_config(None, micro_sets(tmp_path)).model_config()
    base, _ = _base(config, tmp_path / "base")
    run = tmp_path / "run"
    first = _lora_sets(run, base, "lora.base_dtype=bf16", iters=2)
    trainer = Trainer(resolve_config(None, first), console=False)
    assert trainer.model.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    assert trainer.model.layers["0"].attention.wq.lora_A.dtype == torch.float32
    trainer.train()
    again = [
        s
        for s in _lora_sets(run, base, "lora.base_dtype=bf16", iters=3)
        if "checkpoint.load" not in s
    ]
    resumed = [*again, f"lora.base={base}", f"checkpoint.load={run / 'checkpoints'}"]
    assert Trainer(resolve_config(None, resumed), console=False).iteration == 2

    other, _ = _base(config, tmp_path / "other")
    torch.manual_seed(1)
    wrong = [*again, f"lora.base={other}", f"checkpoint.load={run / 'checkpoints'}"]
    with pytest.raises(ConfigError, match="is not the one the adapters"):
        Trainer(resolve_config(None, wrong), console=False)

    result = CliRunner().invoke(train, ["--recipe", "tiny_lora", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "trainable" in result.output and "no optimizer state" in result.output
    bad = ["--recipe", "tiny_lora", "--set", 'lora.targets=["q", "query"]', "--dry-run"]
    result = CliRunner().invoke(train, bad)
    assert result.exit_code == 2 and "lora.targets: unknown query" in result.output


def test_a_frozen_deepseek_base_keeps_its_expert_biases(tmp_path: Path) -> None:
    """DeepSeek-V3 under LoRA (latent attention and expert adapters train): the routers'
    balancing biases, part of the frozen base and absent from adapter checkpoints, stay put."""
    from tests.builders import layout_sets

    sets = layout_sets("tiny_deepseek_v3", tmp_path, "lora.enabled=true", "training.iters=2")
    trainer = Trainer(resolve_config("tiny_deepseek_v3", sets), console=False)
    biases = {n: b.clone() for n, b in trainer.model.named_buffers() if "expert_bias" in n}
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("wkv_a.lora_A" in n for n in trainable)
    assert any("experts.lora.w2_B" in n for n in trainable)
    trainer.train()
    buffers = dict(trainer.model.named_buffers())
    assert biases and all(torch.equal(buffers[n], b) for n, b in biases.items())


def test_an_fp8_base_with_high_precision_adapters(tmp_path: Path) -> None:
    """`--fp8 torchao --lora` (emulated on a CPU): the block linears run in fp8 with adapters
    beside them in high precision; only adapters train, and the losses stay near bf16's."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from pipeline.core.model.lora import LoRAAdapted

    losses = {}
    fp8_sets = ["fp8.recipe=torchao:tensorwise", "fp8.emulate=true", "fp8.linear_filter=all"]
    width = ["training.dtype=bf16", "model.hidden_size=64", "model.ffn_hidden_size=128"]
    for name, fp8 in (("bf16", []), ("fp8", fp8_sets)):
        sets = [*micro_sets(tmp_path / name, "lora.enabled=true", *width, iters=2), *fp8]
        trainer = Trainer(resolve_config(None, sets), console=False)
        losses[name] = trainer.train().losses
        wq = trainer.model.layers["0"].attention.wq
        assert isinstance(wq, LoRAAdapted) and isinstance(wq, Float8Linear) == (name == "fp8")
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_" in n for n in trainable)
    for step, loss in losses["bf16"].items():
        assert losses["fp8"][step] == pytest.approx(loss, rel=2e-2)
