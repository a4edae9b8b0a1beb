"""GRPO's data: prompts per split (`pipeline.data.prompt_dataset`), read from JSONL files and
rendered with the tokenizer's chat template when the run starts, whole epochs of them."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from pipeline.train.config.schema import ConfigError, TrainConfig
from pipeline.train.objectives.datasets import split_sizes

__all__ = ["RepeatedBatches", "prompt_datasets", "skipped_prompts"]


def prompt_datasets(cfg: TrainConfig, blend: Any, tok: Any) -> list[Any]:
    """GRPO's prompts per split, rendered with the tokenizer's chat template, whole epochs of
    them; prompts that leave no room for `grpo.max_completion_length` are skipped and counted.
    With `grpo.num_iterations` > 1 each global batch of the train split comes back that many
    times (the rollouts of its first pass serve the others). `blend` and `tok` are unused: the
    prompt files are `data.blend` (or the split blends) as given."""
    from pipeline.data.prompt_dataset import PromptDataset
    from pipeline.data.prompt_files import PromptFileError, read_prompt_splits
    from pipeline.tokenizer.chat_template import ChatTemplateError, chat_prompt, load_chat_template
    from pipeline.tokenizer.tokenizer import load_tokenizer

    d, t, passes = cfg.data, cfg.training, cfg.grpo.num_iterations
    try:
        template = load_chat_template(d.tokenizer)
        render = partial(chat_prompt, template=template)  # the assistant's turn opened
        if cfg.grpo.tools or cfg.grpo.environment:
            render = tool_renderer(cfg, template)
        sets = read_prompt_splits(
            d.blend,
            d.split,
            (d.train_blend, d.valid_blend, d.test_blend),
            load_tokenizer(d.tokenizer),
            render,
            d.seq_length - cfg.grpo.max_completion_length,
        )
    except (PromptFileError, ChatTemplateError, OSError) as e:
        raise ConfigError(str(e)) from None
    datasets: list[Any] = []
    for index, (found, wanted) in enumerate(zip(sets, split_sizes(cfg))):
        if found is None or not wanted or not found.records:
            datasets.append(None)
            continue
        repeat, per_epoch = (passes if index == 0 else 1), len(found.records)
        epochs = -(-wanted // (repeat * per_epoch))  # whole epochs over the prompts
        dataset = PromptDataset(found.records, epochs * per_epoch, t.seed + index)
        dataset = RepeatedBatches(dataset, t.global_batch_size, repeat) if repeat > 1 else dataset
        dataset.skipped = found.skipped
        datasets.append(dataset)
    return datasets


def tool_renderer(cfg: TrainConfig, template: Any) -> Any:
    """Prompts rendered with the tools' schemas (`grpo.tools` and the environment's methods),
    the assistant's turn opened: what a tool-calling rollout starts from."""
    from pipeline.train.objectives.grpo.tools import offered_schemas, offered_tools

    if template is None:
        raise ConfigError(
            "grpo.tools and grpo.environment need a chat template that renders tools: "
            f"{cfg.data.tokenizer} has none"
        )
    schemas = offered_schemas(*offered_tools(cfg.grpo))

    def render(messages: list[dict]) -> str:
        return template.render(messages, add_generation_prompt=True, tools=schemas).text

    return render


class RepeatedBatches:
    """A dataset whose every run of `batch` samples comes back `times` times in a row: sample i
    is sample `(i // (batch * times)) * batch + i % batch` of `dataset`."""

    def __init__(self, dataset: Any, batch: int, times: int) -> None:
        self.dataset, self.batch, self.times = dataset, batch, times
        self.records = dataset.records

    def __len__(self) -> int:
        return len(self.dataset) * self.times

    def __getitem__(self, index: int) -> Any:
        group, offset = divmod(index, self.batch * self.times)
        return self.dataset[group * self.batch + offset % self.batch]


def skipped_prompts(cfg: TrainConfig, datasets: Sequence[Any]) -> str | None:
    """One line counting the GRPO prompts skipped for their length, per split (None: none)."""
    counts = [
        f"{sum(dataset.skipped.values())} in {name}"
        for name, dataset in zip(("train", "valid", "test"), datasets)
        if dataset is not None and dataset.skipped
    ]
    if not counts:
        return None
    room = cfg.data.seq_length - cfg.grpo.max_completion_length
    return (
        f"skipped prompts longer than {room} tokens (data.seq_length - "
        f"grpo.max_completion_length): {', '.join(counts)}"
    )
