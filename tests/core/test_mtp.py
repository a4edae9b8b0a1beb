"""Multi-token prediction against a hand-written reference (transformers does not run MTP).

The reference follows DeepSeek-V3's definition literally: depth k sees the first T - k positions
only (truncated sequences, no shifting or masking), concatenates the embedding of token i + k
with the previous depth's hidden state, and predicts token i + k + 1 with the shared output
layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy
from pipeline.core.model.flavors import tiny_deepseek_v3
from pipeline.core.model.mtp import mtp_loss_sum
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.layout_rules import model_problems
from pipeline.train.objectives.language_model.objective import micro_batch_loss
from tests.builders import perturbed

DEPTH = 2
SEQ = 12


def _model() -> Transformer:
    config = tiny_deepseek_v3()
    config = dataclasses.replace(
        config,
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        mtp_num_layers=DEPTH,
        mtp_loss_scaling_factor=0.3,
    )
    config.moe.aux_loss_coeff = 0.0
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights()
    return perturbed(model)  # norms and projections away from their init values


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 96, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(2, -1)
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(2, SEQ),
        "position_ids": positions,
    }


def _reference(model: Transformer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    tokens, labels = batch["tokens"], batch["labels"]
    rope = model.rope(batch["position_ids"])
    hidden = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        hidden = layer(hidden, rope, None)
    total = torch.zeros(())
    for k, name in enumerate(sorted(model.mtp, key=int), start=1):
        layer = model.mtp[name]
        kept = SEQ - k
        embedded = layer.enorm(model.tok_embeddings(tokens[:, k:]))
        joined = torch.cat((embedded, layer.hnorm(hidden[:, :kept])), dim=-1)
        hidden = layer(layer.eh_proj(joined), tuple(r[:, :, :kept] for r in rope), None)
        logits = model.output(layer.head_norm(hidden))
        total = total + F.cross_entropy(
            logits.flatten(0, 1), labels[:, k:].flatten(), reduction="sum"
        )
    return 0.3 / DEPTH * total


def test_mtp_loss_equals_the_hand_written_reference() -> None:
    model = _model()
    batch = _batch()
    assert list(model.mtp) == ["2", "3"]  # global layer indices after the main layers
    assert list(model.moe_layers()) == ["1", "2", "3"]  # the MTP blocks are MoE, as DeepSeek's
    model(batch["tokens"], batch["position_ids"])
    ours = mtp_loss_sum(model, model.mtp_input, batch, chunked_linear_cross_entropy)
    torch.testing.assert_close(ours, _reference(model, batch), rtol=1e-5, atol=1e-5)


def test_training_loss_value_is_the_language_model_loss_and_its_gradient_adds_mtp() -> None:
    model, batch = _model(), _batch()
    loss_sum, tokens = micro_batch_loss(model, batch)
    hidden = model(batch["tokens"], batch["position_ids"])
    main, _ = chunked_linear_cross_entropy(
        hidden, model.output.weight, batch["labels"], batch["loss_mask"]
    )
    torch.testing.assert_close(loss_sum, main)  # the reported loss is the LM loss only
    loss_sum.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (main + _reference(model, batch)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ours["mtp.3.eh_proj.weight"].abs().sum() > 0
    with torch.no_grad():  # evaluation: no MTP work
        assert torch.equal(micro_batch_loss(model, batch)[0], main.detach())


def test_mtp_is_refused_under_tensor_pipeline_and_context_parallelism() -> None:
    config = _model().config
    problems = model_problems(tp=2, pp=1, cp=1, ep=1, model=config, seq_length=32)
    assert any("mtp_num_layers" in p for p in problems)
    assert not model_problems(tp=1, pp=1, cp=1, ep=2, model=config, seq_length=32)


@pytest.mark.parametrize("depth", [0, 1])
def test_checkpoint_names(depth: int) -> None:
    config = dataclasses.replace(tiny_deepseek_v3(), num_layers=2, mtp_num_layers=depth)
    with torch.device("meta"):
        names = [n for n, _ in Transformer(config).named_parameters()]
    extra = [n for n in names if n.startswith("mtp.")]
    if depth == 0:
        assert extra == []
    else:
        for part in ("enorm", "hnorm", "eh_proj", "head_norm", "moe.router", "attention.wkv_a"):
            assert any(n.startswith(f"mtp.2.{part}") for n in extra), part


def test_a_run_trains_the_mtp_module_and_moves_its_balancing_bias(tmp_path) -> None:
    """`pipe train` with model.mtp_num_layers = 1: the MTP module's weights and its MoE's
    balancing bias move, and the checkpoint holds them under `mtp.{num_layers}.*`."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer
    from pipeline.weights.pipe_checkpoint import PipeCheckpointSource
    from tests.builders import layout_sets

    sets = layout_sets(
        "tiny_deepseek_v3",
        tmp_path,
        "model.mtp_num_layers=1",
        "training.iters=2",
        "checkpoint.save_interval=2",
    )
    trainer = Trainer(resolve_config("tiny_deepseek_v3", sets), console=False)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    bias = trainer.model.mtp["4"].moe.expert_bias
    assert bias.abs().sum() > 0
    assert not torch.equal(trainer.model.mtp["4"].eh_proj.weight, start["mtp.4.eh_proj.weight"])
    saved = PipeCheckpointSource(tmp_path / "checkpoints")
    assert saved.model_config.mtp_num_layers == 1
    assert torch.equal(saved.read("mtp.4.moe.expert_bias"), bias)
