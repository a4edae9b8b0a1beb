"""Generation with the model's heads split over processes (tensor parallelism, one process per
device, started by torchrun): the training plan without sequence parallelism, so every rank holds
the whole residual stream, computes its own heads and MLP slice, and gets the full logits. Each
rank caches only its own kv heads; latent attention's cache (latent + RoPE key) is replicated.
Every rank runs the same schedule and samples the same tokens from the same logits."""

from __future__ import annotations

import torch

from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.process_group import start_process_group


def tensor_parallel_mesh(device: torch.device):
    """The process group (`start_process_group`) and a one-dimensional device mesh over all
    ranks; `device` is this rank's (`rank_device`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    start_process_group(device)
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))


def shard_for_generation(model: Transformer, mesh) -> Transformer:
    """Split `model`'s heads and MLP over `mesh` (ValueError when the heads do not divide)."""
    from pipeline.core.parallel.tensor_parallel import apply_tensor_parallel

    tp, config = mesh.size(), model.config
    heads = config.num_attention_heads if config.attention_kind == "mla" else config.num_kv_heads
    if heads % tp:
        raise ValueError(f"{heads} attention (kv) heads do not split over {tp} ranks")
    linear = config.linear_attention
    if linear is not None and linear.num_key_heads % tp:
        raise ValueError(
            f"{linear.num_key_heads} linear-attention key heads do not split over {tp} ranks"
        )
    return apply_tensor_parallel(model, mesh, sequence_parallel=False)
