"""The DPO loss against TRL's (the test oracle): on the same pairs and the same two tiny Llama
models (ours and transformers', the same weights), pipe's per-pair losses, rewards and the
policy's gradients equal what TRL's `DPOTrainer._compute_loss` computes on the transformers
models (fp32, 1e-5), for the sigmoid, ipo and label-smoothed (cDPO) losses; with the reference
equal to the policy the sigmoid loss is ln 2.

TRL 1.16 runs its loss without a full trainer: `_compute_loss` reads a few trainer attributes
(set here on an instance made without `__init__`) and an accelerator whose `gather` is recorded,
which gives its per-pair rewards. Its `sigmoid` loss no longer takes `label_smoothing`; its
`aot` loss is the cDPO formula on sorted log-ratios, which for one pair is cDPO itself, so the
label-smoothed case is checked pair by pair."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from pipeline.core.model.hf_names import from_hf_state_dict
from pipeline.train.objectives.dpo.loss import DPOLoss, DPOOptions, dpo_terms, sequence_logps
from pipeline.weights.hf_reader import HFSource
from tests.builders import VOCAB, load_from_source, perturbed, save_hf

trl = pytest.importorskip("trl")
PAIRS, LENGTH = 3, 14


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(our policy, our reference, HF policy, HF reference): the reference a perturbed tiny
    Llama, the policy the reference perturbed again; ours loaded from the HF directories."""
    root = tmp_path_factory.mktemp("dpo_models")
    ref_dir, hf_ref = save_hf("llama", root / "ref")
    torch.manual_seed(1)
    hf_policy = perturbed(copy.deepcopy(hf_ref))
    hf_policy.save_pretrained(root / "policy")
    ours = [load_from_source(HFSource(d)).float() for d in (root / "policy", ref_dir)]
    from trl.trainer.utils import add_fused_lm_head  # TRL's trainer adds these heads

    add_fused_lm_head(hf_policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(hf_ref)
    return ours[0], ours[1], hf_policy, hf_ref


def pair_batch(seed: int = 3):
    """TRL's inputs (chosen rows then rejected rows, completion mask on the input tokens) and
    ours (`[pairs, 2, seq]`, the mask on label positions) for the same random pairs: a shared
    prompt, replies of different lengths, right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, PAIRS, LENGTH), generator=g)
    mask = torch.zeros(2, PAIRS, LENGTH)
    for p in range(PAIRS):
        prompt = 3 + p
        ids[1, p, :prompt] = ids[0, p, :prompt]
        mask[0, p, prompt : LENGTH - p] = 1
        mask[1, p, prompt : LENGTH - 2 * p] = 1
    trl_inputs = {
        "input_ids": ids.reshape(2 * PAIRS, LENGTH),
        "attention_mask": torch.ones(2 * PAIRS, LENGTH, dtype=torch.long),
        "completion_mask": mask.reshape(2 * PAIRS, LENGTH).long(),
    }
    pairs = ids.transpose(0, 1)  # [pairs, 2, length]
    ours = {
        "tokens": pairs[..., :-1].contiguous(),
        "labels": pairs[..., 1:].contiguous(),
        "loss_mask": mask.transpose(0, 1)[..., 1:].contiguous(),
        "position_ids": torch.arange(LENGTH - 1).expand(PAIRS, 2, LENGTH - 1).contiguous(),
    }
    return trl_inputs, ours


def trl_loss(hf_policy, hf_ref, inputs, loss_type: str, beta: float, smoothing: float = 0.0):
    """TRL's loss on `inputs`, and the rewards it gathers (chosen, rejected) per pair."""
    from trl import DPOTrainer

    gathered = []
    accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        gather=lambda t: gathered.append(t) or t,
        gather_for_metrics=lambda t: t,
        unwrap_model=lambda m: m,
    )
    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.__dict__.update(
        accelerator=accelerator,
        model=hf_policy,
        ref_model=hf_ref,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        precompute_ref_logps=False,
        aux_loss_enabled=False,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=smoothing,
        use_weighting=False,
        _total_train_tokens=0,
        _tp_size=1,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    loss = trainer._compute_loss(hf_policy, inputs, return_outputs=False)
    return loss, gathered[0], gathered[1]


def hf_gradients(hf_model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in hf_model.named_parameters() if p.grad is not None}
    hf_model.zero_grad(set_to_none=True)
    return from_hf_state_dict(grads)


def ours_loss(policy, reference, batch, options: DPOOptions):
    loss_fn = DPOLoss(options, reference)
    total, pairs = loss_fn(policy, batch)
    loss = total / pairs
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        logps, counts = sequence_logps(policy, batch)
        terms = dpo_terms(logps, sequence_logps(reference, batch)[0], options, counts)
    return loss.detach(), terms, grads, loss_fn.take_stats()


def assert_close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(("loss_type", "beta"), [("sigmoid", 0.1), ("sigmoid", 2.0), ("ipo", 0.5)])
def test_loss_rewards_and_gradients_equal_trl(models, loss_type, beta) -> None:
    policy, reference, hf_policy, hf_ref = models
    inputs, batch = pair_batch()
    expected, chosen, rejected = trl_loss(hf_policy, hf_ref, inputs, loss_type, beta)
    expected.backward()
    expected_grads = hf_gradients(hf_policy)
    loss, terms, grads, stats = ours_loss(policy, reference, batch, DPOOptions(beta, loss_type))
    assert_close(loss, expected.detach(), "loss")
    assert_close(terms.chosen_rewards, chosen, "chosen rewards")
    assert_close(terms.rejected_rewards, rejected, "rejected rewards")
    assert abs(stats["margin"] - float((chosen - rejected).mean())) < 1e-5
    assert abs(stats["accuracy"] - float((chosen > rejected).double().mean())) < 1e-9
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], f"gradient of {name}")
    assert max(g.abs().max() for g in grads.values()) > 1e-4  # gradients that say something


def test_label_smoothing_equals_trl_cdpo(models) -> None:
    """cDPO (label_smoothing 0.2): TRL's `aot` loss on one pair at a time, averaged."""
    policy, reference, hf_policy, hf_ref = models
    inputs, batch = pair_batch(seed=5)
    beta, smoothing = 0.5, 0.2
    losses = []
    for p in range(PAIRS):
        rows = [p, PAIRS + p]
        one = {k: v[rows] for k, v in inputs.items()}
        loss, *_ = trl_loss(hf_policy, hf_ref, one, "aot", beta, smoothing)
        (loss / PAIRS).backward()
        losses.append(loss.detach())
    expected_grads = hf_gradients(hf_policy)
    options = DPOOptions(beta, "sigmoid", smoothing)
    loss, _, grads, _ = ours_loss(policy, reference, batch, options)
    assert_close(loss, torch.stack(losses).mean(), "loss")
    unsmoothed, *_ = ours_loss(policy, reference, batch, DPOOptions(beta, "sigmoid"))
    assert abs(float(loss - unsmoothed)) > 1e-3  # the smoothing changes the loss
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], f"gradient of {name}")


def test_reference_equal_to_policy_gives_ln2(models) -> None:
    policy, *_ = models
    _, batch = pair_batch()
    loss, terms, _, stats = ours_loss(policy, copy.deepcopy(policy), batch, DPOOptions(0.1))
    assert abs(float(loss) - math.log(2)) < 1e-6
    assert torch.equal(terms.chosen_rewards, torch.zeros(PAIRS))
    assert stats["accuracy"] == 0.0 and stats["margin"] == 0.0


def test_options_refused() -> None:
    for kwargs, problem in [
        ({"loss": "hinge"}, "dpo.loss"),
        ({"beta": 0.0}, "dpo.beta"),
        ({"label_smoothing": 0.5}, "dpo.label_smoothing"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "not ipo"),
    ]:
        with pytest.raises(ValueError, match=problem):
            DPOOptions(**kwargs)


def test_a_lora_runs_reference_is_its_base_without_adapters(models) -> None:
    """With LoRA the reference is the policy with its adapters left out (no second model):
    exactly the base it was adapted from, and the DPO loss and gradients equal those with the
    base as a separate reference."""
    from pipeline.core.model.lora import LoRASpec, adapter_names, apply_lora
    from pipeline.train.objectives.frozen_start import BaseOfLoRA

    _, base, *_ = models
    policy = apply_lora(copy.deepcopy(base), LoRASpec(rank=4, alpha=8.0))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name in adapter_names(policy):
                param.normal_(0.0, 0.05)  # B non-zero: the adapters change the output
    _, batch = pair_batch(seed=9)
    adapted, _ = sequence_logps(policy, batch)
    off, _ = sequence_logps(BaseOfLoRA(policy), batch)
    assert_close(off, sequence_logps(base, batch)[0], "the base's log-probabilities")
    assert float((adapted - off).abs().max()) > 1e-3  # the adapters were left out, then back
    assert_close(sequence_logps(policy, batch)[0], adapted, "adapters back on")
    options = DPOOptions(0.5)
    loss, terms, grads, _ = ours_loss(policy, BaseOfLoRA(policy), batch, options)
    expected, expected_terms, expected_grads, _ = ours_loss(policy, base, batch, options)
    assert_close(loss, expected, "loss")
    assert_close(terms.chosen_rewards, expected_terms.chosen_rewards, "chosen rewards")
    assert grads.keys() == expected_grads.keys() == set(adapter_names(policy))  # base frozen
    for name in adapter_names(policy):
        assert_close(grads[name], expected_grads[name], f"gradient of {name}")
