"""`RemoteRollouts.refresh` streams the gathered weights: the first rank hands the push each
tensor as it is gathered, the other ranks take part in every gather and keep none of them."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import torch

import pipeline.train.objectives.grpo.remote as grpo_remote
from pipeline.train.objectives.grpo.remote import RemoteRollouts


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
        self.register_buffer("freqs", torch.ones(5), persistent=False)  # not pushed


def _gathered(monkeypatch) -> tuple[list[str], list[int]]:
    """Stand in for `named_full_tensors`: each "gathered" tensor a fresh copy; records the
    names gathered and how many earlier copies were still alive at each gather."""
    names, alive, copies = [], [], []

    def gather(model):
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            gc.collect()
            alive.append(sum(ref() is not None for ref in copies))
            copy = tensor.detach().clone()
            copies.append(weakref.ref(copy))
            names.append(name)
            yield name, copy
            del copy

    monkeypatch.setattr(grpo_remote, "named_full_tensors", gather)
    return names, alive


def _rollouts(rank: int) -> tuple[RemoteRollouts, list]:
    pushed = []

    class Client:
        def push(self, named_tensors, weight_version=None):
            assert not isinstance(named_tensors, dict)  # an iterable consumed as it gathers
            pushed.append((weight_version, [name for name, _ in named_tensors]))

    layout = SimpleNamespace(rank=rank, world_group=None)
    rollouts = RemoteRollouts("http://127.0.0.1:9", _Policy(), layout)
    rollouts.client = Client()
    return rollouts, pushed


def test_the_first_rank_pushes_each_saved_tensor_once(monkeypatch) -> None:
    names, _ = _gathered(monkeypatch)
    rollouts, pushed = _rollouts(rank=0)
    rollouts.refresh()
    assert pushed == [("pipe-train-1", ["a.weight", "a.bias", "b.weight", "b.bias"])]
    assert names == ["a.weight", "a.bias", "b.weight", "b.bias", "freqs"]


def test_the_other_ranks_gather_every_tensor_and_keep_none(monkeypatch) -> None:
    names, alive = _gathered(monkeypatch)
    rollouts, pushed = _rollouts(rank=1)
    rollouts.refresh()
    assert pushed == []
    assert names == ["a.weight", "a.bias", "b.weight", "b.bias", "freqs"]
    assert alive == [0, 0, 0, 0, 0]
