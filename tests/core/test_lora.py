"""LoRA adapters on our model against `peft` on transformers (the oracle): the same weights,
adapters and batch give the same logits and the same adapter gradients; plus what adapting
changes (frozen base, zero B, names) and the peft key format. CPU, fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.core.model.lora import (
    ExpertAdapters,
    LoRALinear,
    LoRASpec,
    adapter_names,
    apply_lora,
    init_adapters,
)
from pipeline.weights.lora_files import peft_tensors
from tests.builders import SEQ, VOCAB, build_model, hf_case, perturbed

peft = pytest.importorskip("peft")

HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapted_pair(rank: int = 4, alpha: float = 8.0):
    """(our adapted model, peft's) on the same tiny Llama, with the same non-zero adapters."""
    hf_cls, hf_config, config = hf_case("llama")
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = perturbed(hf_cls(hf_config).eval())
    ours = build_model(config)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    apply_lora(ours, LoRASpec(rank=rank, alpha=alpha))
    init_adapters(ours, seed=3)
    with torch.no_grad():  # B starts at zero; make it not, so A gets a gradient
        for name, param in ours.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(std=0.2, generator=torch.Generator().manual_seed(len(name)))
    lora_config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=HF_MODULES)
    theirs = peft.get_peft_model(hf, lora_config)
    adapters = {n: p.detach() for n, p in ours.named_parameters() if n in adapter_names(ours)}
    result = peft.set_peft_model_state_dict(
        theirs, peft_tensors(adapters, None, "LlamaForCausalLM")
    )
    assert not result.unexpected_keys
    return ours, theirs


def test_adapter_gradients_equal_peft() -> None:
    """Same batch, CE loss: logits agree to 1e-5 and every adapter's gradient (A and B of all
    seven projections of every layer) to 1e-5; the base has no gradient in either."""
    ours, theirs = _adapted_pair()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    logits, peft_logits = ours.logits(tokens), theirs(input_ids=tokens).logits
    assert (logits - peft_logits).abs().max() < 1e-5
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(peft_logits.flatten(0, 1), labels.flatten()).backward()

    peft_grads = {
        n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if p.requires_grad
    }
    names = adapter_names(ours)
    assert len(names) == 2 * 7 * 2
    params = dict(ours.named_parameters())
    ours_as_peft = peft_tensors({n: params[n].grad for n in names}, None, "LlamaForCausalLM")
    assert ours_as_peft.keys() == peft_grads.keys()
    for name, grad in ours_as_peft.items():
        assert grad.abs().max() > 0, name
        assert (grad - peft_grads[name]).abs().max() < 1e-5, name
    frozen = [n for n, p in ours.named_parameters() if n not in names]
    assert all(params[n].grad is None and not params[n].requires_grad for n in frozen)


def test_fresh_adapters_leave_the_model_unchanged_and_follow_peft_init() -> None:
    """B = 0: the adapted model computes the base's logits; A is uniform in +-1/sqrt(in) (peft's
    kaiming-uniform with a = sqrt(5)), drawn the same for the same seed and name."""
    _, _, config = hf_case("llama")
    base = build_model(config)
    tokens = torch.randint(0, VOCAB, (1, SEQ))
    expected = base.logits(tokens)
    apply_lora(base, LoRASpec(rank=8, targets=("q", "down")))
    init_adapters(base, seed=5)
    assert torch.equal(base.logits(tokens), expected)
    wq = base.layers["0"].attention.wq
    assert isinstance(wq, LoRALinear) and not isinstance(base.layers["0"].attention.wk, LoRALinear)
    bound = 1 / config.hidden_size**0.5
    assert wq.lora_A.abs().max() <= bound and wq.lora_A.abs().max() > 0.9 * bound
    again = build_model(config)
    apply_lora(again, LoRASpec(rank=8, targets=("q", "down")))
    init_adapters(again, seed=5)
    assert torch.equal(again.layers["0"].attention.wq.lora_A, wq.lora_A)


def test_expert_adapters_match_per_expert_linears() -> None:
    """Adapters on a MoE's experts: each expert's output is its own linear plus its own B A x."""
    from pipeline.core.model.config import ModelConfig, MoEConfig

    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.0),
    )
    model = build_model(config)
    apply_lora(model, LoRASpec(rank=2, alpha=4, targets=("expert_gate", "expert_down")))
    init_adapters(model, seed=0)
    experts = model.layers["0"].moe.experts
    assert isinstance(experts.lora, ExpertAdapters) and experts.lora.stacks == ("w1", "w2")
    with torch.no_grad():
        experts.lora.w1_B.normal_()
        experts.lora.w2_B.normal_()
    x = torch.randn(6, 32)
    counts = torch.tensor([1, 2, 0, 3])
    out = experts(x, counts)
    rows, lo = list(torch.split(x, counts.tolist())), experts.lora
    expected = []
    for e, g in enumerate(rows):
        gate = g @ experts.w1[e].t() + g @ lo.w1_A[e].t() @ lo.w1_B[e].t() * 2
        h = F.silu(gate) * (g @ experts.w3[e].t())
        expected.append(h @ experts.w2[e].t() + h @ lo.w2_A[e].t() @ lo.w2_B[e].t() * 2)
    assert torch.allclose(out, torch.cat(expected), atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.0.moe.experts.lora.{w}_{ab}" for w in ("w1", "w2") for ab in "AB"}


def test_bad_targets_and_expert_adapters_in_peft_files(tmp_path) -> None:
    """Expert adapters go to peft files one expert at a time, under the on-disk module names,
    and read back stacked."""
    from pipeline.weights.lora_files import read_adapters

    with pytest.raises(ValueError, match="unknown LoRA target"):
        LoRASpec(targets=("q", "query"))
    ours = {
        "layers.1.moe.experts.lora.w1_A": torch.randn(4, 2, 8),
        "layers.1.moe.experts.lora.w1_B": torch.randn(4, 6, 2),
    }
    files = peft_tensors(ours, 4, "MixtralForCausalLM")
    prefix = "base_model.model.model.layers.1.block_sparse_moe.experts"
    assert torch.equal(
        files[f"{prefix}.3.w1.lora_B.weight"], ours["layers.1.moe.experts.lora.w1_B"][3]
    )
    assert len(files) == 8
    from safetensors.torch import save_file

    tmp_path.joinpath("adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 2, "lora_alpha": 4}'
    )
    save_file(files, str(tmp_path / "adapter_model.safetensors"))
    record, back = read_adapters(tmp_path)
    assert record == {"rank": 2, "alpha": 4.0} and back.keys() == ours.keys()
    assert all(torch.equal(back[n], t) for n, t in ours.items())
