"""What every objective's data building shares: the samples each split wants (Megatron's rule)
and the token datasets of a blend, built through the same blends and splits whatever the
sample (`pipeline.data.blended`). An objective's own data module (`NAME/data.py`) calls these
from the function its registry entry names as `datasets`."""

from __future__ import annotations

from typing import Any

from pipeline.data.blend_spec import PerSplitBlend
from pipeline.data.blended import build_datasets
from pipeline.data.gpt_dataset import GPTDatasetConfig
from pipeline.train.config.schema import ConfigError, TrainConfig

__all__ = ["blend_datasets", "split_sizes"]


def split_sizes(cfg: TrainConfig) -> tuple[int, int, int]:
    """Samples wanted per split, by Megatron's rule (valid is 0 when evaluation is off)."""
    t = cfg.training
    gbs = t.global_batch_size
    if t.eval_interval == 0 or t.eval_iters == 0:
        return t.iters * gbs, 0, 0
    return t.iters * gbs, (t.iters // t.eval_interval + 1) * t.eval_iters * gbs, t.eval_iters * gbs


def blend_datasets(
    cfg: TrainConfig,
    blend: Any,
    tok: Any,
    dataset_class: type,
    config_class: type = GPTDatasetConfig,
    **extra: Any,
) -> list[Any]:
    """Train, valid and test datasets of `dataset_class` over `blend` (None for a split without
    data), configured from `cfg.data` and the tokenizer `tok` (its EOD id and identity);
    `extra` goes to `config_class`."""
    d = cfg.data
    identity = (tok.fingerprint or {}).get("files") or tok.source
    config = config_class(
        sequence_length=d.seq_length,
        eod_id=tok.eod_id,
        tokenizer_id=str(identity),
        random_seed=cfg.training.seed,
        split=None if isinstance(blend, PerSplitBlend) else d.split,
        add_extra_token_to_sequence=d.add_extra_token_to_sequence,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,  # the model takes document ids instead of a dense mask
        path_to_cache=d.data_cache_path,
        pad_id=None,
        **extra,
    )
    try:
        return build_datasets(blend, config, split_sizes(cfg), dataset_class=dataset_class)
    except (ValueError, OSError) as e:
        raise ConfigError(f"building the datasets: {e}") from e
