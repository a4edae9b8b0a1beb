"""DeepSeek-V3's auxiliary-loss-free balancing bias: it moves against the load, evens the load
out, stands still on skipped steps, and survives save/resume bit-exactly."""

from __future__ import annotations

import torch

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.core.model.moe import MoE
from pipeline.train.loop.expert_bias import update_expert_biases

EXPERTS, TOKENS, HIDDEN = 8, 256, 16


def _favouring_moe(rate: float = 0.02) -> tuple[ModelConfig, MoE, torch.Tensor]:
    """A one-layer config, its sigmoid-routed MoE whose router sends every token of the
    returned input to expert 0 (feature 0 is constant 1 and only expert 0 reads it)."""
    moe_config = MoEConfig(
        num_experts=EXPERTS,
        top_k=2,
        ffn_hidden_size=8,
        aux_loss_coeff=0.0,
        score_function="sigmoid",
        expert_bias=True,
        expert_bias_update_rate=rate,
    )
    config = ModelConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        num_layers=1,
        num_attention_heads=2,
        ffn_hidden_size=32,
        moe=moe_config,
    )
    torch.manual_seed(0)
    moe = MoE(HIDDEN, 8, moe_config)
    moe.init_weights(0.5, 0.02)  # varied scores: tokens differ in their other choices
    with torch.no_grad():
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[0, 0] = 4.0
    x = torch.randn(TOKENS, HIDDEN)
    x[:, 0] = 1.0
    return config, moe.train(), x


def _imbalance(load: torch.Tensor) -> float:
    return float(load.max() / load.mean())


def test_favoured_experts_bias_falls_and_load_evens_out() -> None:
    config, moe, x = _favouring_moe()
    imbalance, bias0 = [], []
    for _ in range(60):
        with torch.no_grad():
            moe(x)
        imbalance.append(_imbalance(moe.expert_load))
        update_expert_biases(config, {"0": moe})
        bias0.append(float(moe.expert_bias[0]))
        assert moe.expert_load is None  # read and reset by the update
    assert imbalance[0] > 3.5  # 4: every token's k=2 assignments would include expert 0
    assert bias0[:5] == sorted(bias0[:5], reverse=True) and bias0[4] < bias0[0] < 0
    assert float(moe.expert_bias[0]) == float(moe.expert_bias.min())
    assert max(imbalance[-10:]) < 1.5
    # The bias only chose: the weights are still plain renormalised sigmoid scores.
    _, weights, chosen = moe.route(moe.router(x))
    scores = torch.sigmoid(moe.router(x)).gather(1, chosen)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))


def test_skipped_step_leaves_the_bias() -> None:
    config, moe, x = _favouring_moe()
    with torch.no_grad():
        moe(x)
    update_expert_biases(config, {"0": moe}, apply=torch.tensor(False))
    assert moe.expert_bias.abs().max() == 0 and moe.expert_load is None


def test_evaluation_forwards_do_not_count() -> None:
    _, moe, x = _favouring_moe()
    with torch.no_grad():
        moe.eval()(x)
    assert moe.expert_load is None


MICRO_DEEPSEEK = [
    "model.num_layers=3",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=64",
    "model.vocab_size=128",
    "model.max_position_embeddings=32",
    "data.mock=true",
    "data.seq_length=32",
    "data.num_workers=0",
    "training.micro_batch_size=2",
    "training.global_batch_size=4",
    "training.log_interval=1",
    "training.eval_interval=100",
    "training.dtype=fp32",
    "training.device=cpu",
    "scheduler.warmup_iters=1",
    "scheduler.decay_iters=10",
    "checkpoint.save_interval=3",
]


def _biases(trainer) -> dict[str, torch.Tensor]:
    return {i: moe.expert_bias.clone() for i, moe in trainer.model.moe_layers().items()}


def test_training_moves_the_bias_and_resume_restores_it_bit_exactly(tmp_path) -> None:
    """`pipe train` of tiny_deepseek_v3 moves the biases (they start at zero), saves them, and
    a run resumed from the checkpoint starts from exactly those biases, then keeps moving them
    as the uninterrupted run does."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    def trainer(run: str, iters: int, *extra: str) -> Trainer:
        sets = [*MICRO_DEEPSEEK, f"logging.run_dir={tmp_path / run}", f"training.iters={iters}"]
        return Trainer(resolve_config("tiny_deepseek_v3", [*sets, *extra]), console=False)

    first = trainer("first", 3)
    assert set(_biases(first)) == {"1", "2"}  # layer 0 is dense
    first.train()
    saved = _biases(first)
    assert all(bias.abs().max() > 0 for bias in saved.values())
    checkpoint = tmp_path / "first" / "checkpoints" / "iter_0000003"
    resumed = trainer("resumed", 5, f"checkpoint.load={checkpoint}")
    for i, bias in _biases(resumed).items():
        assert torch.equal(bias, saved[i]), i
    resumed.train()
    uninterrupted = trainer("uninterrupted", 5)
    uninterrupted.train()
    for i, bias in _biases(uninterrupted).items():
        assert torch.equal(bias, _biases(resumed)[i]), i
