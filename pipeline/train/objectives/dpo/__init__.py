"""DPO, the registry's entry `dpo` (`pipe train --dpo`): preference pairs against a frozen
reference. Torch-free: the class is `objective.py` (with `loss.py` and `reference.py`), the
data `data.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.train.objectives import ObjectiveSpec
from pipeline.train.objectives.dpo.settings import DPOSection

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["SPECS"]


def _dpo_problems(cfg: TrainConfig) -> list[str]:
    """DPO trains on whole preference pairs against a frozen reference."""
    problems = []
    if cfg.data.mock:
        problems.append(
            "data.kind = dpo trains on preference pairs; mock data has none: pass --data "
            "PREFIX (made by `pipe preprocess --preference`)"
        )
    k = cfg.dpo
    if k.beta <= 0 or not 0.0 <= k.label_smoothing < 0.5:
        problems.append("dpo.beta must be > 0 and dpo.label_smoothing in [0, 0.5)")
    if k.loss == "ipo" and k.label_smoothing:
        problems.append("dpo.label_smoothing applies to the sigmoid loss, not ipo")
    if cfg.model.mtp_num_layers:
        problems.append("data.kind = dpo trains no multi-token prediction: model.mtp_num_layers 0")
    return problems


def _chosen_side(prefix: str) -> str:
    """The manifest of a preference prefix lies beside its chosen side."""
    from pipeline.data.preference_dataset import preference_prefix

    return f"{preference_prefix(prefix)}_chosen_document"


SPECS = (
    ObjectiveSpec(
        "dpo",
        "pipeline.train.objectives.dpo.objective:DPO",
        "preference tuning: the DPO loss of chosen/rejected pairs against a frozen reference",
        datasets="pipeline.train.objectives.dpo.data:preference_datasets",
        manifest_dataset=_chosen_side,
        sequences_per_sample=2,
        chat_prompts=True,
        problems=_dpo_problems,
        section=DPOSection,
        flag_help="Preference tuning (DPO) on chosen/rejected pairs (pipe preprocess "
        "--preference; --data PREFIX): the [dpo] loss against the starting weights, frozen "
        "(data.kind=dpo).",
    ),
)
