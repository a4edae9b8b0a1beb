"""Tensor (and sequence) parallelism against the single-process model: loss and every gradient.

Each gloo rank builds the reference model from the same seed, deep-copies it, shards the copy
over a 2-rank tp mesh and runs the same batch through both: forward, fused loss, backward. The
sharded run changes only the order of fp32 sums (row-parallel partial sums, the vocabulary-split
softmax), so losses agree to about 1e-7 and gradients and logits to a few 1e-6 (measured); the
1e-5 tolerance leaves room for that without hiding a wrong reduction, which is off by 0.5 or more
here (a dropped all-reduce of the hidden-state gradient was measured at 0.5-1.2).
The init std is raised to 0.2 so logits and gradients are far from zero and a mistake shows.
"""

from __future__ import annotations

import pytest

from pipeline.core.parallel.tensor_parallel import padded_vocab_size
from tests.builders import micro_model_config
from tests.distributed import run_distributed

ATOL = 1e-5


def test_padded_vocab_size():
    assert padded_vocab_size(128, 1) == 128
    assert padded_vocab_size(128256, 8) == 129024
    assert padded_vocab_size(32000, 2) == 32000
    assert padded_vocab_size(32001, 2) == 32256


def _config(variant: str):
    """A micro model; "mla*" use latent attention (with and without the q low-rank projection),
    "mla_moe" with DeepSeekMoE (shared expert, grouped sigmoid routing, a non-zero bias)."""
    from pipeline.core.model.config import MLAConfig, MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2) if variant == "moe" else None
    if variant == "mla_moe":
        moe = MoEConfig(
            num_experts=4,
            top_k=2,
            score_function="sigmoid",
            num_groups=2,
            topk_groups=1,
            num_shared_experts=1,
            expert_bias=True,
            routed_scaling_factor=2.0,
        )
    mla = None
    if variant.startswith("mla"):
        q_lora = None if variant == "mla_no_q_lora" else 24
        mla = MLAConfig(
            kv_lora_rank=16,
            q_lora_rank=q_lora,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
        )
    return micro_model_config(
        vocab_size=127 if variant == "uneven_vocab" else 128,
        init_method_std=0.2,
        tie_word_embeddings=variant == "tied",
        moe=moe,
        mla=mla,
    )


def _compare(rank, world_size, tmp, variants):
    """Run every (variant, sequence_parallel) case; return the worst differences per case."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy
    from pipeline.core.model.transformer import Transformer
    from pipeline.core.parallel.tensor_parallel import (
        apply_tensor_parallel,
        sum_moe_gradients,
        tp_linear_cross_entropy,
    )

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    batch, seq, chunk = 2, 8, 5  # chunks of 5 tokens cross the batch boundary
    results = {}
    for variant in variants:
        for sp in (True, False):
            torch.manual_seed(0)
            ref = Transformer(_config(variant))
            ref.init_weights()
            for moe in ref.moe_layers().values():
                if moe.config.expert_bias:
                    moe.expert_bias.copy_(torch.randn(moe.config.num_experts) * 0.1)
            model = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=sp)
            vocab = ref.config.vocab_size
            docs = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
            losses = []
            for _ in range(2):  # two micro-batches: gradients accumulate
                tokens = torch.randint(0, vocab, (batch, seq))
                labels = torch.randint(0, vocab, (batch, seq))
                mask = (torch.rand(batch, seq) > 0.2).float()
                # Default position ids: under SP they must come from the global sequence length.
                loss_ref, n = chunked_linear_cross_entropy(
                    ref(tokens, None, docs), ref.output.weight, labels, mask, chunk
                )
                loss, n_tp = tp_linear_cross_entropy(
                    model(tokens, None, docs), model.output.weight, labels, mask, chunk
                )
                (loss_ref / n).backward()
                (loss / n_tp).backward()
                assert n == n_tp
                losses.append(abs(loss.item() / n_tp.item() - loss_ref.item() / n.item()))
            # Under SP each rank's MoE saw only its tokens: the step sums those gradients.
            sum_moe_gradients(model)
            worst, placements_ok = 0.0, True
            ref_params = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                grad = p.grad
                if isinstance(grad, DTensor):
                    placements_ok &= grad.placements == p.placements
                    grad = grad.full_tensor()
                worst = max(worst, (grad - ref_params[name].grad).abs().max().item())
            with torch.no_grad():
                logits_diff = model.logits(tokens, None, docs) - ref.logits(tokens, None, docs)
            results[(variant, sp)] = {
                "loss": max(losses),
                "grad": worst,
                "logits": logits_diff.abs().max().item(),
                "placements_ok": placements_ok,
                "n_params": len(ref_params),
                "tp_params": sum(1 for _ in model.parameters()),
                "sharded": isinstance(_head_split_weight(model.layers["0"].attention), DTensor),
            }
    return results


def _head_split_weight(attention):
    return attention.wkv_b.weight if attention.kind == "mla" else attention.wq.weight


@pytest.mark.dist
def test_tensor_parallel_matches_single_process(tmp_path):
    """Dense, tied embeddings, MoE (experts replicated), a vocabulary of 127 (uneven shards) and
    latent attention (heads split, down projections and the RoPE key replicated; with and
    without q_lora_rank; with DeepSeekMoE), each with sequence parallelism on and off, over two
    accumulated micro-batches."""
    variants = ("dense", "tied", "moe", "uneven_vocab", "mla", "mla_no_q_lora", "mla_moe")
    results = run_distributed(_compare, 2, tmp_path, variants)
    for per_rank in results:
        assert len(per_rank) == 2 * len(variants)
        for case, r in per_rank.items():
            assert r["sharded"], case
            assert r["tp_params"] == r["n_params"], case  # tied weights stay tied
            assert r["placements_ok"], case  # gradients are laid out like their parameters
            assert r["loss"] < ATOL, (case, r)
            assert r["grad"] < ATOL, (case, r)
            assert r["logits"] < ATOL, (case, r)
